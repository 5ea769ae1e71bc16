# SPDX-License-Identifier: Apache-2.0
"""Record upstream's engine accessor values over a corpus of real configs (fixture of test_engine_accessors.py).

Two steps, from a directory other than the repository root:

1. ``python record_engine_accessors.py corpus OUT.json`` (with transformers and accelerate installed): the corpus.
   HF Trainer's ZeRO-2 and ZeRO-3 "auto" templates after the Trainer fills them (``HfTrainerDeepSpeedConfig``'s
   ``trainer_config_process`` and ``trainer_config_finalize``), OpenRLHF's ``get_train_ds_config`` /
   ``get_eval_ds_config`` outputs (as its strategy completes them with the batch sizes), Megatron-DeepSpeed's
   example configs.
2. ``/work/upvenv/bin/python record_engine_accessors.py record OUT.json FIXTURE.json`` (upstream 0.19.8 installed):
   for every config, every config accessor of upstream's ``DeepSpeedEngine``, called on an engine object holding
   only upstream's parsed config (world size 1), its value normalised to JSON.
"""

import json
import sys

# Accessors whose value depends only on the config (and on there being no client optimizer).
ACCESSORS = (
    "aio_config bf16_master_weights_and_gradients bf16_optimizer_states bfloat16_enabled "
    "checkpoint_serialization_enabled checkpoint_tag_validation_enabled checkpoint_tag_validation_fail "
    "checkpoint_writer_enabled communication_data_type cpuadam_cores_perc dataloader_drop_last dump_state "
    "dynamic_loss_scale dynamic_loss_scale_args flops_profiler_detailed flops_profiler_enabled "
    "flops_profiler_module_depth flops_profiler_output_file flops_profiler_profile_step "
    "flops_profiler_recompute_fwd_factor flops_profiler_top_modules fp16_auto_cast fp16_enabled "
    "fp16_master_weights_and_gradients get_batch_info get_data_types gradient_accumulation_steps gradient_clipping "
    "gradient_predivide_factor initial_dynamic_scale is_deepcompile_enabled is_first_weights_partition_group "
    "is_sanity_checks_enabled load_universal_checkpoint log_level loss_scale managed_gradient_accumulation "
    "memory_breakdown optimizer_legacy_fusion optimizer_name optimizer_params postscale_gradients scheduler_name "
    "scheduler_params steps_per_print super_offload tensor_parallel_config torch_autocast_enabled "
    "train_batch_size train_micro_batch_size_per_gpu use_node_local_storage wall_clock_breakdown zenflow_config "
    "zero_allgather_bucket_size zero_allgather_partitions zero_allgather_sequential zero_allow_untested_optimizer "
    "zero_compute_grad_norm zero_contiguous_gradients zero_cpu_offload zero_elastic_checkpoint "
    "zero_force_ds_cpu_optimizer zero_gather_16bit_weights_on_model_save zero_hpz_partition_size "
    "zero_ignore_unused_parameters zero_legacy_stage1 zero_load_from_fp32_weights zero_log_trace_cache_warnings "
    "zero_max_live_parameters zero_max_reuse_distance zero_model_persistence_threshold "
    "zero_module_granularity_threshold zero_multi_rank_bucket_allreduce zero_offload_optimizer zero_offload_param "
    "zero_optimization zero_optimization_partition_gradients zero_optimization_partition_weights "
    "zero_optimization_stage zero_overlap_comm zero_param_persistence_threshold zero_parameter_alignment "
    "zero_partial_offload zero_prefetch_bucket_size zero_quantized_gradients zero_quantized_nontrainable_weights "
    "zero_quantized_weights zero_reduce_bucket_size zero_reduce_scatter zero_round_robin_gradients "
    "zero_save_muon_momentum_buffer_in_memory zero_sub_group_size zero_use_cpu_optimizer autotuning_enabled "
    "autotuning_start_profile_step autotuning_end_profile_step autotuning_metric autotuning_profile_model_info "
    "data_efficiency_enabled data_sampling_enabled curriculum_learning_enabled random_ltd_enabled "
    "compile_autosp compile_autotp uses_parallelization_pass_only autotp_size").split()


def normalise(value):
    """A JSON form of an accessor's value, comparable between upstream's objects and this package's."""
    import enum
    import torch
    if callable(value) and not isinstance(value, type) and hasattr(value, "__self__"):
        value = value()  # get_batch_info returns bound methods
    if isinstance(value, enum.Enum):
        return normalise(value.value)
    if isinstance(value, torch.dtype):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): normalise(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [normalise(v) for v in value]
    if hasattr(value, "model_dump"):
        return normalise(value.model_dump())
    if hasattr(value, "__dataclass_fields__"):
        return {k: normalise(getattr(value, k)) for k in value.__dataclass_fields__}
    if hasattr(value, "__dict__"):
        return {k: normalise(v) for k, v in vars(value).items() if not k.startswith("_")}
    return repr(value)


def _hf_templates():
    fp16 = {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1
    }
    common = {
        "fp16": fp16,
        "bf16": {
            "enabled": "auto"
        },
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": "auto",
                "betas": "auto",
                "eps": "auto",
                "weight_decay": "auto"
            }
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto"
            }
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }
    zero2 = {
        "stage": 2,
        "offload_optimizer": {
            "device": "cpu",
            "pin_memory": True
        },
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True
    }
    zero3 = {
        "stage": 3,
        "offload_optimizer": {
            "device": "cpu",
            "pin_memory": True
        },
        "offload_param": {
            "device": "cpu",
            "pin_memory": True
        },
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True
    }
    zero3_gpu = {
        "stage": 3,
        "overlap_comm": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto"
    }
    return [("hf-zero2-fp16", dict(common, zero_optimization=zero2), {
        "fp16": True
    }), ("hf-zero3-bf16", dict(common, zero_optimization=zero3), {
        "bf16": True
    }),
            ("hf-zero3-gpu-gas4", dict(common, zero_optimization=zero3_gpu), {
                "bf16": True,
                "gradient_accumulation_steps": 4
            })]


def _hf_filled():
    import copy
    import types
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
    out = []
    for name, template, overrides in _hf_templates():
        args = TrainingArguments(output_dir="/tmp/hf_ds_corpus",
                                 per_device_train_batch_size=4,
                                 learning_rate=3e-5,
                                 weight_decay=0.01,
                                 warmup_steps=7,
                                 max_grad_norm=0.5,
                                 report_to=[],
                                 use_cpu=True,
                                 **overrides)
        ds = HfTrainerDeepSpeedConfig(copy.deepcopy(template))
        ds.trainer_config_process(args)
        model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=64, hidden_sizes=None))
        ds.trainer_config_finalize(args, model, num_training_steps=100)
        out.append((name, ds.config))
    return out


def _openrlhf_train(stage, adam_offload, bf16, grad_accum_dtype, overlap_comm, micro, batch):
    """OpenRLHF's get_train_ds_config output, with the batch sizes its strategy adds."""
    zero = {
        "stage": stage,
        "offload_param": {
            "device": "none"
        },
        "offload_optimizer": {
            "device": "cpu" if adam_offload else "none",
            "pin_memory": True
        },
        "sub_group_size": "auto",
        "stage3_max_live_parameters": "auto",
        "stage3_max_reuse_distance": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "reduce_bucket_size": "auto",
        "zero_hpz_partition_size": 1,
        "zero_quantized_weights": False,
        "zero_quantized_gradients": False
    }
    if overlap_comm:
        zero["overlap_comm"] = True
        zero["contiguous_gradients"] = True
    if stage == 3:
        zero["reduce_scatter"] = True
    return {
        "steps_per_print": 100,
        "zero_optimization": zero,
        "bf16": {
            "enabled": bf16
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "data_types": {
            "grad_accum_dtype": grad_accum_dtype
        },
        "train_micro_batch_size_per_gpu": micro,
        "train_batch_size": batch
    }


def _openrlhf_eval(stage, offload, bf16, micro, batch):
    zero = {
        "stage": stage,
        "stage3_max_live_parameters": "auto",
        "stage3_max_reuse_distance": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "offload_param": {
            "device": "cpu" if offload else "none",
            "pin_memory": True
        }
    }
    return {
        "steps_per_print": 100,
        "zero_optimization": zero,
        "bf16": {
            "enabled": bf16
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "train_micro_batch_size_per_gpu": micro,
        "train_batch_size": batch
    }


def _megatron():
    fp16 = {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 500,
        "hysteresis": 2,
        "min_loss_scale": 1,
        "initial_scale_power": 11
    }
    return [
        ("megatron-gpt-fp16-z1", {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": 10,
            "zero_optimization": {
                "stage": 1
            },
            "gradient_clipping": 1.0,
            "prescale_gradients": True,
            "fp16": fp16,
            "wall_clock_breakdown": False
        }),
        ("megatron-bf16-fp32-accum", {
            "train_batch_size": 16,
            "train_micro_batch_size_per_gpu": 2,
            "steps_per_print": 10,
            "zero_optimization": {
                "stage": 1
            },
            "bf16": {
                "enabled": True
            },
            "data_types": {
                "grad_accum_dtype": "fp32"
            },
            "wall_clock_breakdown": False
        }),
        ("megatron-z3-hpz-bf16", {
            "train_batch_size": 8,
            "train_micro_batch_size_per_gpu": 1,
            "steps_per_print": 1,
            "gradient_accumulation_steps": 8,
            "zero_optimization": {
                "stage": 3,
                "overlap_comm": True,
                "zero_hpz_partition_size": 1,
                "contiguous_gradients": True
            },
            "gradient_clipping": 1.0,
            "prescale_gradients": False,
            "communication_data_type": "bf16",
            "bf16": {
                "enabled": True
            },
            "wall_clock_breakdown": False
        }),
        ("megatron-llama-static-scale", {
            "train_batch_size": 4,
            "train_micro_batch_size_per_gpu": 1,
            "steps_per_print": 1,
            "zero_optimization": {
                "stage": 2,
                "reduce_bucket_size": 10000000,
                "reduce_scatter": True,
                "contiguous_gradients": True,
                "overlap_comm": True
            },
            "gradient_clipping": 1.0,
            "prescale_gradients": False,
            "fp16": dict(fp16, loss_scale=65536),
            "wall_clock_breakdown": True
        }),
        ("bigscience-elastic", {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": 1.0,
            "zero_optimization": {
                "stage": 1,
                "elastic_checkpoint": True
            },
            "fp16": fp16,
            "steps_per_print": 100,
            "wall_clock_breakdown": True,
            "flops_profiler": {
                "enabled": False
            }
        }),
    ]


def corpus():
    configs = list(_hf_filled())
    configs += [("openrlhf-train-z2-bf16", _openrlhf_train(2, False, True, None, False, 2, 16)),
                ("openrlhf-train-z3-adam-offload", _openrlhf_train(3, True, True, "fp32", True, 1, 8)),
                ("openrlhf-train-z1-fp32", _openrlhf_train(1, False, False, None, True, 4, 4)),
                ("openrlhf-eval-z3-offload", _openrlhf_eval(3, True, True, 2, 2)),
                ("openrlhf-eval-z0", _openrlhf_eval(0, False, True, 4, 8))]
    configs += _megatron()
    return [{"name": name, "config": config} for name, config in configs]


def record(corpus_path, fixture_path):
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine
    entries = json.load(open(corpus_path))
    for entry in entries:
        engine = DeepSpeedEngine.__new__(DeepSpeedEngine)
        vars(engine).update(_parameters={},
                            _buffers={},
                            _modules={},
                            client_optimizer=None,
                            optimizer=None,
                            _config=DeepSpeedConfig(entry["config"]))
        values = {}
        for name in ACCESSORS:
            attr = getattr(DeepSpeedEngine, name)
            values[name] = normalise(attr.fget(engine) if isinstance(attr, property) else attr(engine))
        entry["upstream"] = values
    with open(fixture_path, "w") as handle:
        json.dump({"upstream_version": deepspeed.__version__, "configs": entries}, handle, indent=1, sort_keys=True)
        handle.write("\n")


if __name__ == "__main__":
    if sys.argv[1] == "corpus":
        json.dump(corpus(), open(sys.argv[2], "w"), indent=1)
    else:
        record(sys.argv[2], sys.argv[3])
