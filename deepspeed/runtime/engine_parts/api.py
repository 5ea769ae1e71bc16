# SPDX-License-Identifier: Apache-2.0
"""The rest of upstream's ``DeepSpeedEngine`` surface, as data.

Every public name of upstream 0.19.8's ``DeepSpeedEngine`` and ``PipelineEngine`` (the generated list in
:mod:`deepspeed.runtime.engine_parts.names`) is, on an engine here, one of:

* a method of the engine's own classes (``engine.py``, the checkpoint mixin, the methods below);
* a *config accessor* of :data:`CONFIG_ACCESSORS`: the value upstream's accessor of the same name returns
  for the same config, read from the parsed config (``tests/unit/runtime/test_engine_accessors.py`` checks
  them against values recorded with upstream over a corpus of real configs);
* *refused*, :data:`REFUSED`: calling it raises ``NotImplementedError`` naming the method and pointing to
  docs/compatibility.md (internals of upstream's reduction path, features this runtime does not build).

``DeepSpeedEngine.__getattr__`` never hands an upstream engine name to the wrapped module: a name of the list
that is not resolved raises an ``AttributeError`` that names the engine method, not the user's model class.
"""

import operator
import os

import torch

from deepspeed.runtime.engine_parts.usage_errors import EngineUsageError
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.stages import communication_dtype
from deepspeed.utils import groups

DOCS = "docs/compatibility.md"


def _attr(path, default=None, missing=False):
    """An accessor returning ``self._config.<path>`` (``default`` when a step of the path is None, or, with
    ``missing``, absent)."""
    getter = operator.attrgetter(path)

    def accessor(self):
        try:
            value = getter(self._config)
        except AttributeError:
            if missing:
                return default
            raise
        return default if value is None else value

    return accessor


def _zero(key, default=None):
    return _attr(f"zero_config.{key}", default)


def _offload_optimizer(key, default):

    def accessor(self):
        section = self._config.zero_config.offload_optimizer
        return getattr(section, key, default) if section is not None else default

    return accessor


def _checkpoint(key):

    def accessor(self):
        return self._config.checkpoint_config[key]

    return accessor


# Upstream's defaults of sections this runtime refuses when enabled (autotuning, data efficiency): an engine
# here only exists with them off, and then upstream's accessors return these.
_AUTOTUNING_DEFAULTS = {"enabled": False, "start_profile_step": 3, "end_profile_step": 5, "metric": "throughput"}
_DATA_EFFICIENCY_OFF = {
    "data_sampling": {
        "enabled": False,
        "curriculum_learning": {
            "enabled": False
        },
    },
    "data_routing": {
        "random_ltd": {
            "enabled": False
        }
    },
}


def _const(value):
    return lambda self: value


def _loose_section(name):
    """The raw dict of a top-level section (empty when absent)."""

    def accessor(self):
        value = self._config._param_dict.get(name)
        return value if isinstance(value, dict) else {}

    return accessor


# name -> accessor (self -> value); see the module docstring.
CONFIG_ACCESSORS = {
    "aio_config": lambda self: _aio(self._config.aio_config),
    "bf16_master_weights_and_gradients": _attr("bfloat16_config.bf16_master_weights_and_grads"),
    "bf16_optimizer_states": _attr("bfloat16_config.bf16_optimizer_states"),
    "checkpoint_serialization_enabled": _checkpoint("checkpoint_serialization"),
    "checkpoint_tag_validation_enabled": lambda self: self._config.checkpoint_config["tag_validation"] != "IGNORE",
    "checkpoint_tag_validation_fail": lambda self: self._config.checkpoint_config["tag_validation"] == "FAIL",
    "checkpoint_writer_enabled": lambda self: self._config.checkpoint_config["writer"] is not None,
    "cpuadam_cores_perc": _offload_optimizer("cpuadam_cores_perc", 0.9),
    "dataloader_drop_last": _attr("dataloader_drop_last"),
    "dump_state": _attr("dump_state"),
    "dynamic_loss_scale": lambda self: self._config.float16_config.loss_scale == 0,
    "dynamic_loss_scale_args": lambda self: self._config.float16_config.dynamic_loss_scale_args(),
    "flops_profiler_enabled": _attr("flops_profiler_config.enabled"),
    "flops_profiler_module_depth": _attr("flops_profiler_config.module_depth"),
    "flops_profiler_output_file": _attr("flops_profiler_config.output_file"),
    "flops_profiler_recompute_fwd_factor": _attr("flops_profiler_config.recompute_fwd_factor"),
    "flops_profiler_top_modules": _attr("flops_profiler_config.top_modules"),
    "flops_profiler_profile_step": _attr("flops_profiler_config.profile_step"),
    "flops_profiler_detailed": _attr("flops_profiler_config.detailed"),
    "fp16_auto_cast": _attr("float16_config.auto_cast"),
    "fp16_master_weights_and_gradients": _attr("float16_config.fp16_master_weights_and_grads"),
    "gradient_predivide_factor": _attr("gradient_predivide_factor"),
    "initial_dynamic_scale": _attr("initial_dynamic_scale"),
    "is_sanity_checks_enabled": _zero("enable_sanity_checks"),
    "load_universal_checkpoint": _attr("load_universal_checkpoint"),
    "loss_scale": _attr("float16_config.loss_scale"),
    "memory_breakdown": _attr("memory_breakdown"),
    "optimizer_legacy_fusion": _attr("optimizer_legacy_fusion"),
    "optimizer_params": _attr("optimizer_params"),
    "postscale_gradients": lambda self: not self._config.prescale_gradients,
    "scheduler_name": _attr("scheduler_name"),
    "scheduler_params": _attr("scheduler_params"),
    "super_offload": _offload_optimizer("super_offload", False),
    "use_node_local_storage": _attr("use_node_local_storage"),
    "zenflow_config": _zero("zenflow"),
    "zero_allgather_bucket_size": _zero("allgather_bucket_size"),
    "zero_allgather_partitions": _zero("allgather_partitions"),
    "zero_allgather_sequential": _zero("allgather_sequential"),
    "zero_allow_untested_optimizer": _attr("zero_allow_untested_optimizer"),
    "zero_compute_grad_norm": _zero("compute_grad_norm"),
    "zero_contiguous_gradients": _zero("contiguous_gradients"),
    "zero_cpu_offload": lambda self: _offload_device(self) == OffloadDeviceEnum.cpu,
    "zero_elastic_checkpoint": _zero("elastic_checkpoint"),
    "zero_force_ds_cpu_optimizer": _attr("zero_force_ds_cpu_optimizer"),
    "zero_hpz_partition_size": _zero("zero_hpz_partition_size"),
    "zero_ignore_unused_parameters": _zero("ignore_unused_parameters"),
    "zero_legacy_stage1": _zero("legacy_stage1"),
    "zero_load_from_fp32_weights": _zero("load_from_fp32_weights"),
    "zero_log_trace_cache_warnings": _zero("log_trace_cache_warnings"),
    "zero_max_live_parameters": _zero("max_live_parameters"),
    "zero_max_reuse_distance": _zero("max_reuse_distance"),
    "zero_model_persistence_threshold": _zero("model_persistence_threshold"),
    "zero_module_granularity_threshold": _zero("module_granularity_threshold"),
    "zero_multi_rank_bucket_allreduce": _zero("use_multi_rank_bucket_allreduce"),
    "zero_offload_optimizer": _zero("offload_optimizer"),
    "zero_offload_param": _zero("offload_param"),
    "zero_optimization_partition_gradients": lambda self: self._config.zero_optimization_stage >= 2,
    "zero_optimization_partition_weights": lambda self: self._config.zero_optimization_stage >= 3,
    "is_first_weights_partition_group": lambda self: self._config.zero_optimization_stage >= 3,
    "zero_overlap_comm": _zero("overlap_comm"),
    "zero_param_persistence_threshold": _zero("param_persistence_threshold"),
    "zero_parameter_alignment": _zero("parameter_alignment"),
    "zero_partial_offload": _offload_optimizer("ratio", 1.0),
    "zero_prefetch_bucket_size": _zero("prefetch_bucket_size"),
    "zero_quantized_gradients": _zero("zero_quantized_gradients"),
    "zero_quantized_nontrainable_weights": _zero("zero_quantized_nontrainable_weights"),
    "zero_quantized_weights": _zero("zero_quantized_weights"),
    "zero_reduce_bucket_size": _zero("reduce_bucket_size"),
    "zero_reduce_scatter": _zero("reduce_scatter"),
    "zero_round_robin_gradients": _zero("round_robin_gradients"),
    "zero_save_muon_momentum_buffer_in_memory": _zero("save_muon_momentum_buffer_in_memory"),
    "zero_sub_group_size": _zero("sub_group_size"),
    "zero_use_cpu_optimizer": lambda self: _offload_device(self) in (OffloadDeviceEnum.cpu, OffloadDeviceEnum.nvme),
    # sections refused when enabled: upstream's values with them off
    "autotuning_enabled": _const(False),
    "autotuning_start_profile_step": _const(_AUTOTUNING_DEFAULTS["start_profile_step"]),
    "autotuning_end_profile_step": _const(_AUTOTUNING_DEFAULTS["end_profile_step"]),
    "autotuning_metric": _const(_AUTOTUNING_DEFAULTS["metric"]),
    "autotuning_profile_model_info": _const(False),
    "autotuning_metric_path": lambda self: os.path.join(os.getcwd(), "autotuning_metric.json"),
    "autotuning_model_info_path": lambda self: os.path.join(os.getcwd(), "autotuning_model_info.json"),
    "data_efficiency_enabled": _const(False),
    "data_sampling_enabled": _const(False),
    "curriculum_learning_enabled": _const(False),
    "random_ltd_enabled": _const(False),
    "swap_tensor_config": _const(None),
    "compile_autosp": lambda self: "autosp" in self._compile_settings().passes,
    "compile_autotp": lambda self: "autotp" in self._compile_settings().passes,
    "compile_zero_optimization_stage": lambda self: bool({"z1", "z3"} & set(self._compile_settings().passes)),
    "uses_parallelization_pass_only": lambda self: bool({"autosp", "autotp"} & set(self._compile_settings().passes)),
    "is_deepcompile_enabled": lambda self: self._compile_settings().deepcompile,
}


def _aio(section):
    """The ``aio`` section under upstream 0.19.8's key names (``intra_op_parallelism``, once ``thread_count``)."""
    out = dict(section)
    out["intra_op_parallelism"] = out.pop("thread_count", 1)
    return out


def _offload_device(engine):
    section = engine._config.zero_config.offload_optimizer
    return None if section is None else section.device


# name -> why it is not built here (the error adds the name and docs/compatibility.md).
REFUSED = {
    name: "upstream's gradient reduction internals; here the ZeRO stage's gradient pipeline reduces every gradient"
    for name in ("allreduce_and_copy", "allreduce_bucket", "allreduce_gradients", "allreduce_no_retain",
                 "buffered_allreduce_fallback", "sparse_allreduce", "sparse_allreduce_bucket",
                 "sparse_allreduce_no_retain", "sparse_all_gather", "all_gather_scalar", "clip_fp32_gradients")
}
REFUSED.update({
    "curriculum_learning_config":
    "curriculum learning (data_efficiency / curriculum_learning) is not built",
    "data_efficiency_config":
    "data efficiency is not built",
    "data_sampling_config":
    "data efficiency's data sampling is not built",
    "random_ltd_config":
    "random-LTD (data efficiency) is not built",
    "random_ltd_initialize":
    "random-LTD (data efficiency) is not built",
    "set_custom_curriculum_learning_schedule":
    "curriculum learning is not built",
    "set_data_post_process_func":
    "data efficiency's data post-processing is not built",
    "get_optimizer_configuration":
    "upstream's optimizer-factory internals; the config's optimizer is built by "
    "deepspeed.runtime.engine_parts.optimizer_factory",
    "load_moe_state_dict":
    "upstream's MoE checkpoint internals; engine.load_checkpoint loads expert states",
    "get_autosp_backend":
    "DeepCompile's AutoSP pass is not built (engine.compile() runs torch.compile)",
    "get_autotp_backend":
    "DeepCompile's AutoTP pass is not built (engine.compile() runs torch.compile)",
    "get_deepcompile_backend":
    "DeepCompile's backend is not built: 'compile.deepcompile' runs engine.compile() "
    "(torch.compile with the engine's hooks eager)",
    "get_deepspeed_compile_backend":
    "DeepCompile's backend is not built: 'compile.deepcompile' runs "
    "engine.compile() (torch.compile with the engine's hooks eager)",
    "register_compile_pass":
    "DeepCompile's graph passes are not built (engine.compile() runs torch.compile)",
    "get_compile_time":
    "DeepCompile's pass timings are not built",
    "print_forward_breakdown":
    "upstream's forward timing printout; see wall_clock_breakdown",
    "mem_status":
    "upstream's pipeline memory printout",
})


def _refusal(name, reason):

    def refused(self, *args, **kwargs):
        raise NotImplementedError(f"engine.{name}() is not supported in this runtime: {reason}; see {DOCS}")

    refused.__name__ = name
    refused.__doc__ = f"Not supported here: {reason} (raises NotImplementedError)."
    return refused


class EngineAPI:
    """Mixin of :class:`~deepspeed.runtime.engine.DeepSpeedEngine`: the surface of the module docstring."""

    # ------------------------------------------------------------ state offload
    def offload_states(self, include=None, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False):
        """Move the engine's states off the device (RL colocation); see :mod:`deepspeed.runtime.engine_parts.states`.

        ``include``: the :class:`~deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum` kinds to move (None:
        all); ``device``: ``"cpu"`` (``"none"`` moves nothing, ``"nvme"`` raises, as upstream); ``pin_memory``:
        page-locked host copies (fast reloads); ``non_blocking``: return before the copies finish."""
        self._states.offload(include=include, device=device, pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking=False):
        """Bring every offloaded state back to the device, in place; training continues with the same bits."""
        self._states.reload(non_blocking=non_blocking)

    # ---------------------------------------------------------- batch sizes
    def set_train_batch_size(self, train_batch_size):
        """Change the global batch size by changing GAS (the micro-batch size stays). The next accumulation
        window has exactly the new GAS micro-steps; call it between windows (EngineUsageError otherwise)."""
        micro, world = self.train_micro_batch_size_per_gpu(), self.dp_world_size
        if train_batch_size % (micro * world) != 0:
            raise ValueError(f"set_train_batch_size({train_batch_size}): the train batch size must be divisible by "
                             f"train_micro_batch_size_per_gpu * data-parallel size = {micro} * {world}")
        self._require_window_start("set_train_batch_size")
        gas = train_batch_size // (micro * world)
        self._config.train_batch_size = train_batch_size
        self._config.gradient_accumulation_steps = gas
        self.window.set_gradient_accumulation_steps(gas)

    def set_train_micro_batch_size(self, micro_batch_size):
        """Change the micro-batch size, GAS kept: the global batch size follows (as upstream)."""
        self._config.train_batch_size = micro_batch_size * self.gradient_accumulation_steps() * self.dp_world_size
        self._config.train_micro_batch_size_per_gpu = micro_batch_size

    def _require_window_start(self, what):
        stage = self._stage
        if stage is not None and not stage.window_is_empty():
            raise EngineUsageError(f"engine.{what}() between a backward and its step(): the window in progress "
                                   f"was scaled for its GAS; call it after step() at an accumulation boundary")

    def get_batch_info(self):
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``, the bound methods,
        as upstream returns them."""
        return (self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps)

    # ----------------------------------------------------------------- ranks
    def get_data_parallel_rank(self):
        return groups.get_data_parallel_rank()

    def get_model_parallel_rank(self):
        return groups.get_model_parallel_rank()

    def get_tensor_parallel_rank(self):
        return groups.get_tensor_model_parallel_rank()

    def get_sequence_parallel_group(self):
        return groups._get_sequence_parallel_group()

    # -------------------------------------------------------------- optimizer
    def _get_optimizer_param(self, name):
        if self.optimizer is None:
            return []
        return [group.get(name, 0.0) for group in self.optimizer.param_groups]

    def get_type(self):
        return self._get_optimizer_param("type")

    def optimizer_name(self):
        client = getattr(self, "_client_optimizer", None)
        return type(client).__name__ if client is not None else self._config.optimizer_name

    def get_mom(self):
        if self.optimizer_name() in ("SGD", "RMSprop"):
            return self._get_optimizer_param("momentum")
        return self._get_optimizer_param("betas")

    def zero_nvme_offload_optimizer(self):
        stage = self._stage
        host_step = getattr(stage, "host_step", None) if stage is not None else None
        return host_step is not None and host_step.swap is not None

    # ------------------------------------------------------------------ misc
    @property
    def communication_data_type(self):
        configured = communication_dtype(self._config, self.mesh.description.sequence_parallel_size)
        if configured is not None:
            return configured
        if self.fp16_enabled():
            return torch.float16
        if self.bfloat16_enabled():
            return torch.bfloat16
        return torch.float32

    @communication_data_type.setter
    def communication_data_type(self, value):
        """Reduce gradients in ``value`` from the next reduction on (upstream reads the setting at every
        reduction); None: the accumulation dtype."""
        if self.mesh.description.sequence_parallel_size > 1:
            self._config.seq_parallel_communication_data_type = value
        else:
            self._config.communication_data_type = value
        if self._stage is not None:
            self._stage.geometry.set_comm_dtype(value)

    def get_data_types(self):
        """``(model dtype, gradient accumulation dtype)``."""
        model = torch.float16 if self.fp16_enabled() else torch.bfloat16 if self.bfloat16_enabled() else torch.float32
        return model, self._config.grad_accum_dtype or model

    def collect_python_gc(self):
        import gc
        return gc.collect()

    def is_deepcompile_active(self):
        """Whether the compiled path of ``compile.deepcompile`` runs (``engine.compile()`` was called)."""
        return bool(self._compile_settings().deepcompile and self._is_compiled)

    def save_fp16_model(self, save_dir, save_filename="pytorch_model.bin"):
        return self.save_16bit_model(save_dir, save_filename)

    def load_module_state_dict(self,
                               checkpoint,
                               strict=True,
                               custom_load_fn=None,
                               fetch_z3_params=False,
                               z3_params_to_fetch=None,
                               allowed_missing_keys=None):
        """Load ``checkpoint["module"]`` into the model (``custom_load_fn(src=, dst=)`` instead, when given)."""
        state = checkpoint["module"] if "module" in checkpoint else checkpoint
        if custom_load_fn is not None:
            custom_load_fn(src=state, dst=self.module)
            return
        from deepspeed.runtime.zero import GatheredParameters
        params = list(self.module.parameters()) if self.zero_optimization_stage() == 3 else []
        with GatheredParameters(params, modifier_rank=0 if params else None, enabled=bool(params)):
            self.module.load_state_dict(state, strict=strict)

    @staticmethod
    def is_map_style_dataset(obj):
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj):
        return isinstance(obj, torch.utils.data.IterableDataset)


for _name, _accessor in CONFIG_ACCESSORS.items():
    _accessor.__name__ = _name
    _accessor.__doc__ = f"Upstream's ``{_name}()`` for this engine's config."
    setattr(EngineAPI, _name, _accessor)
for _name, _reason in REFUSED.items():
    setattr(EngineAPI, _name, _refusal(_name, _reason))
del _name, _accessor, _reason
