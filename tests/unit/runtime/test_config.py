# SPDX-License-Identifier: Apache-2.0
"""Tests of ``DeepSpeedConfig``: parsing, upstream defaults, the batch identity and every validation error.

Expected values are upstream's documented defaults or plain arithmetic on the inputs; every error case
checks that the message names the offending key path. Configs in the tables are written flat, with
dotted keys (``{"zero_optimization.stage": 3}``), and expanded into nested dicts by :func:`expand`.
"""

import base64
import copy
import dataclasses
import json
import logging
import math

import pytest
import torch

from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError, load_config, resolve_batch_sizes
from deepspeed.runtime.config_utils import find_auto_values
from deepspeed.runtime.zero.config import get_zero_config
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

BASE = {"train_batch_size": 8}


def expand(flat):
    """``{"a.b": 1, "a.c": 2}`` -> ``{"a": {"b": 1, "c": 2}}``."""
    nested = {}
    for dotted, value in flat.items():
        *parents, leaf = dotted.split(".")
        node = nested
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return nested


def make(flat=None, world_size=1):
    config = copy.deepcopy(BASE)
    config.update(expand(flat or {}))
    return DeepSpeedConfig(config, world_size=world_size)


class _Records(logging.Handler):

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append((record.levelno, record.getMessage()))


@pytest.fixture
def config_log():
    """Records of the config logger, attached directly so logger propagation settings do not matter."""
    target = logging.getLogger("DeepSpeed.config")
    handler, old_level = _Records(), target.level
    target.addHandler(handler)
    target.setLevel(logging.DEBUG)
    yield handler.messages
    target.removeHandler(handler)
    target.setLevel(old_level)


#########################################
# Loading
#########################################

FULL = expand({
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 3,
    "gradient_clipping": 0.5,
    "steps_per_print": 7,
    "bf16.enabled": True,
    "optimizer.type": "AdamW",
    "optimizer.params": {
        "lr": 1e-3,
        "betas": [0.9, 0.95]
    },
    "scheduler.type": "WarmupLR",
    "scheduler.params": {
        "warmup_num_steps": 10
    },
    "zero_optimization.stage": 2,
    "zero_optimization.reduce_bucket_size": 5e7,
    "zero_optimization.offload_optimizer": {
        "device": "cpu",
        "pin_memory": True
    },
})


def _summary(cfg):
    return (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
            cfg.gradient_clipping, cfg.steps_per_print, cfg.bfloat16_enabled, cfg.optimizer_name, cfg.optimizer_params,
            cfg.scheduler_name, cfg.scheduler_params, cfg.zero_config)


def test_dict_and_json_path_parse_identically(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(FULL))
    from_dict = DeepSpeedConfig(FULL, world_size=2)
    from_str = DeepSpeedConfig(str(path), world_size=2)
    from_pathlike = DeepSpeedConfig(path, world_size=2)
    assert _summary(from_dict) == _summary(from_str) == _summary(from_pathlike)
    assert from_str._param_dict == FULL
    assert from_dict.train_batch_size == 2 * 3 * 2
    assert from_dict.zero_config.reduce_bucket_size == 50_000_000
    assert from_dict.zero_config.offload_optimizer.pin_memory is True


def test_base64_config_string():
    encoded = base64.urlsafe_b64encode(json.dumps(FULL).encode()).decode()
    assert _summary(DeepSpeedConfig(encoded, world_size=2)) == _summary(DeepSpeedConfig(FULL, world_size=2))


def test_dict_is_deep_copied_and_left_untouched():
    config = copy.deepcopy(FULL)
    cfg = DeepSpeedConfig(config, world_size=1)
    assert config == FULL
    config["optimizer"]["params"]["lr"] = 5.0
    config["zero_optimization"]["stage"] = 3
    assert cfg._param_dict["optimizer"]["params"]["lr"] == 1e-3
    assert cfg.optimizer_params["lr"] == 1e-3
    assert cfg.zero_optimization_stage == 2


@pytest.mark.parametrize("bad", [42, None, ["train_batch_size", 8], b"{}"])
def test_load_config_rejects_other_types(bad):
    with pytest.raises(TypeError):
        load_config(bad)


@pytest.mark.parametrize("text, fragment", [
    ('{"train_batch_size": 8, "train_batch_size": 16}', "duplicate key 'train_batch_size'"),
    ('{"train_batch_size": 8,,}', "not valid JSON"),
    ('[1, 2]', "JSON object"),
])
def test_bad_json_files(tmp_path, text, fragment):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(DeepSpeedConfigError, match=fragment):
        DeepSpeedConfig(str(path))


def test_missing_path(tmp_path):
    with pytest.raises(DeepSpeedConfigError, match="does not exist"):
        DeepSpeedConfig(str(tmp_path / "nope.json"))


def test_json_numbers_and_infinity(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"train_batch_size": 4, "steps_per_print": Infinity, '
                    '"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 3e9}}')
    cfg = DeepSpeedConfig(str(path))
    assert cfg.steps_per_print == math.inf
    assert cfg.zero_config.stage3_max_live_parameters == 3_000_000_000
    assert type(cfg.zero_config.stage3_max_live_parameters) is int


#########################################
# Defaults (upstream's documented values)
#########################################


@pytest.mark.parametrize("attr, expected", [
    ("gradient_clipping", 1.0),
    ("steps_per_print", 10),
    ("wall_clock_breakdown", False),
    ("prescale_gradients", False),
    ("gradient_predivide_factor", 1.0),
    ("gradient_allreduce_op", "mean"),
    ("communication_data_type", None),
    ("grad_accum_dtype", None),
    ("managed_gradient_accumulation", True),
    ("zero_allow_untested_optimizer", False),
    ("zero_force_ds_cpu_optimizer", True),
    ("optimizer_name", None),
    ("optimizer_params", None),
    ("scheduler_name", None),
    ("scheduler_params", None),
    ("fp16_enabled", False),
    ("fp16_auto_cast", False),
    ("loss_scale", 0.0),
    ("initial_dynamic_scale", 2.0**16),
    ("dynamic_loss_scale_args", None),
    ("bfloat16_enabled", False),
    ("bfloat16_immediate_grad_update", False),
    ("zero_optimization_stage", 0),
    ("zero_enabled", False),
    ("tensorboard_config", {}),
    ("csv_monitor_config", {}),
    ("wandb_config", {}),
])
def test_top_level_defaults(attr, expected):
    assert getattr(make(), attr) == expected


@pytest.mark.parametrize("section, key, expected", [
    ("activation_checkpointing_config", "partition_activations", False),
    ("activation_checkpointing_config", "contiguous_memory_optimization", False),
    ("activation_checkpointing_config", "cpu_checkpointing", False),
    ("activation_checkpointing_config", "number_checkpoints", None),
    ("activation_checkpointing_config", "synchronize_checkpoint_boundary", False),
    ("activation_checkpointing_config", "profile", False),
    ("checkpoint_config", "tag_validation", "WARN"),
    ("checkpoint_config", "load_universal", False),
    ("checkpoint_config", "use_node_local_storage", False),
    ("aio_config", "block_size", 1048576),
    ("aio_config", "queue_depth", 8),
    ("aio_config", "thread_count", 1),
    ("aio_config", "single_submit", False),
    ("aio_config", "overlap_events", True),
])
def test_dict_section_defaults(section, key, expected):
    value = getattr(make(), section)
    assert value[key] == expected
    assert getattr(value, key) == expected


@pytest.mark.parametrize("attr, expected", [
    ("stage", 0),
    ("contiguous_gradients", True),
    ("reduce_scatter", True),
    ("reduce_bucket_size", 500_000_000),
    ("allgather_partitions", True),
    ("allgather_bucket_size", 500_000_000),
    ("overlap_comm", False),
    ("round_robin_gradients", False),
    ("ignore_unused_parameters", True),
    ("offload_optimizer", None),
    ("offload_param", None),
    ("sub_group_size", 1_000_000_000),
    ("stage3_prefetch_bucket_size", 50_000_000),
    ("stage3_param_persistence_threshold", 100_000),
    ("stage3_max_live_parameters", 1_000_000_000),
    ("stage3_max_reuse_distance", 1_000_000_000),
    ("stage3_gather_16bit_weights_on_model_save", False),
    ("elastic_checkpoint", False),
    ("load_from_fp32_weights", True),
    ("memory_efficient_linear", True),
    ("zero_hpz_partition_size", 1),
    ("zero_quantized_weights", False),
    ("zero_quantized_gradients", False),
    ("use_multi_rank_bucket_allreduce", True),
    ("stage3_module_granularity_threshold", 0),
    ("stage3_use_all_reduce_for_fetch_params", False),
    ("log_trace_cache_warnings", False),
    ("legacy_stage1", False),
    ("zeropp_loco_param", None),
])
def test_zero_defaults(attr, expected):
    assert getattr(make().zero_config, attr) == expected


@pytest.mark.parametrize("section, attr, expected", [
    ("offload_optimizer", "pin_memory", True),
    ("offload_optimizer", "nvme_path", None),
    ("offload_optimizer", "buffer_count", 4),
    ("offload_optimizer", "fast_init", False),
    ("offload_optimizer", "ratio", 1.0),
    ("offload_param", "pin_memory", True),
    ("offload_param", "nvme_path", None),
    ("offload_param", "buffer_count", 5),
    ("offload_param", "buffer_size", 100_000_000),
    ("offload_param", "max_in_cpu", 1_000_000_000),
])
def test_offload_defaults(section, attr, expected):
    cfg = make({"zero_optimization.stage": 3, f"zero_optimization.{section}.device": "cpu"})
    offload = getattr(cfg.zero_config, section)
    assert offload.device == "cpu" and offload.device is OffloadDeviceEnum.cpu
    assert getattr(offload, attr) == expected


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("given", [None, True, False])
def test_overlap_comm_resolution(stage, given):
    flat = {"zero_optimization.stage": stage}
    if given is not None:
        flat["zero_optimization.overlap_comm"] = given
    cfg = make(flat)
    assert cfg.zero_config.overlap_comm is (given if given is not None else stage == 3)
    assert cfg.zero_enabled is (stage > 0)


def test_zero_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        make().zero_config.stage = 3


#########################################
# Aliases, deprecated spellings and conversions
#########################################


@pytest.mark.parametrize("value", [5e8, 500_000_000, 15099494.4, 0])
def test_sizes_accept_numbers_and_become_ints(value):
    zero = make({
        "zero_optimization.stage": 3,
        "zero_optimization.reduce_bucket_size": value,
        "zero_optimization.stage3_prefetch_bucket_size": value,
    }).zero_config
    for got in (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size):
        assert type(got) is int
        assert got == math.floor(value)


@pytest.mark.parametrize("key, attr", [
    ("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
    ("prefetch_bucket_size", "prefetch_bucket_size"),
    ("stage3_param_persistence_threshold", "param_persistence_threshold"),
    ("stage3_max_live_parameters", "max_live_parameters"),
    ("stage3_max_reuse_distance", "max_reuse_distance"),
    ("stage3_module_granularity_threshold", "module_granularity_threshold"),
])
def test_stage3_keys_with_or_without_prefix(key, attr):
    zero = make({"zero_optimization.stage": 3, f"zero_optimization.{key}": 1.2e4}).zero_config
    assert getattr(zero, attr) == 12_000
    assert getattr(zero, "stage3_" + attr) == 12_000


@pytest.mark.parametrize("key",
                         ["stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"])
def test_gather_16bit_weights_spellings(key):
    zero = make({"zero_optimization.stage": 3, f"zero_optimization.{key}": True}).zero_config
    assert zero.gather_16bit_weights_on_model_save is True
    assert zero.stage3_gather_16bit_weights_on_model_save is True


@pytest.mark.parametrize("old_key, new_key", [("cpu_offload", "offload_optimizer"),
                                              ("cpu_offload_param", "offload_param")])
@pytest.mark.parametrize("pin", [None, True])
def test_deprecated_cpu_offload_flags(old_key, new_key, pin):
    flat = {"zero_optimization.stage": 3, f"zero_optimization.{old_key}": True}
    if pin is not None:
        flat["zero_optimization.cpu_offload_use_pin_memory"] = pin
    offload = getattr(make(flat).zero_config, new_key)
    assert offload.device == OffloadDeviceEnum.cpu
    assert offload.pin_memory is bool(pin)


@pytest.mark.parametrize("stage", [2, 3])
def test_elastic_checkpoint_warns_at_stage_3(monkeypatch, stage):
    """As upstream: ZeRO-3 with elastic_checkpoint warns through deepspeed.utils.logger that it is deprecated."""
    import deepspeed.utils
    messages = []
    monkeypatch.setattr(deepspeed.utils.logger, "warning", lambda message, *a, **k: messages.append(message))
    assert get_zero_config({"zero_optimization": {"stage": stage, "elastic_checkpoint": True}}).elastic_checkpoint
    assert any("elastic checkpointing is deprecated" in m.lower() for m in messages) == (stage == 3)


def test_legacy_boolean_zero_optimization():
    assert get_zero_config({"zero_optimization": False}).stage == 0
    zero = get_zero_config({"zero_optimization": True, "allgather_size": 1e6})
    assert (zero.stage, zero.allgather_bucket_size) == (1, 1_000_000)


@pytest.mark.parametrize("spelling, dtype", [
    ("fp32", torch.float32),
    ("float32", torch.float32),
    ("fp16", torch.float16),
    ("float16", torch.float16),
    ("bf16", torch.bfloat16),
    ("bfloat16", torch.bfloat16),
    ("BF16", torch.bfloat16),
])
def test_dtype_spellings(spelling, dtype):
    cfg = make({"communication_data_type": spelling, "data_types.grad_accum_dtype": spelling})
    assert cfg.communication_data_type is dtype
    assert cfg.grad_accum_dtype is dtype


@pytest.mark.parametrize("given, name", [
    ("Adam", "adam"),
    ("AdamW", "adamw"),
    ("SGD", "sgd"),
    ("Lamb", "lamb"),
    ("Adagrad", "adagrad"),
    ("OneBitAdam", "onebitadam"),
    ("ZeroOneAdam", "zerooneadam"),
    ("OneBitLamb", "onebitlamb"),
    ("Lion", "lion"),
    ("Muon", "muon"),
    ("RMSprop", "rmsprop"),
    ("adamw", "adamw"),
])
def test_optimizer_types(given, name):
    cfg = make({"optimizer.type": given, "optimizer.params.lr": 0.1})
    assert cfg.optimizer_name == name
    assert cfg.optimizer_params == {"lr": 0.1}


@pytest.mark.parametrize("given, name", [
    ("WarmupLR", "WarmupLR"),
    ("WarmupDecayLR", "WarmupDecayLR"),
    ("WarmupCosineLR", "WarmupCosineLR"),
    ("OneCycle", "OneCycle"),
    ("LRRangeTest", "LRRangeTest"),
    ("warmuplr", "WarmupLR"),
    ("StepLR", "StepLR"),
])
def test_scheduler_types(given, name):
    cfg = make({"scheduler.type": given, "scheduler.params.warmup_num_steps": 3})
    assert cfg.scheduler_name == name
    assert cfg.scheduler_params == {"warmup_num_steps": 3}


def test_fp16_dynamic_loss_scale_args():
    cfg = make({
        "fp16.enabled": True,
        "fp16.initial_scale_power": 12,
        "fp16.loss_scale_window": 500,
        "fp16.hysteresis": 3,
        "fp16.consecutive_hysteresis": True,
        "fp16.min_loss_scale": 2,
    })
    assert cfg.fp16_enabled and cfg.loss_scale == 0
    assert cfg.initial_dynamic_scale == 2.0**12
    assert cfg.dynamic_loss_scale_args == {
        "init_scale": 2.0**12,
        "scale_window": 500,
        "delayed_shift": 3,
        "consecutive_hysteresis": True,
        "min_scale": 2,
    }


def test_fp16_static_loss_scale():
    cfg = make({"fp16.enabled": True, "fp16.loss_scale": 128})
    assert cfg.loss_scale == 128.0
    assert cfg.dynamic_loss_scale_args is None


@pytest.mark.parametrize("section", ["bf16", "bfloat16"])
def test_bf16_section_names(section):
    cfg = make({f"{section}.enabled": True, f"{section}.immediate_grad_update": True})
    assert cfg.bfloat16_enabled and cfg.bfloat16_immediate_grad_update


@pytest.mark.parametrize("value, expected", [(1, 1), (250, 250), (float("inf"), math.inf), (None, math.inf)])
def test_steps_per_print_values(value, expected):
    assert make({"steps_per_print": value}).steps_per_print == expected


def test_checkpoint_and_aio_sections():
    cfg = make({
        "checkpoint.tag_validation": "fail",
        "checkpoint.load_universal": True,
        "checkpoint.writer.type": "python",
        "aio.block_size": 262144,
        "aio.intra_op_parallelism": 4,
    })
    assert cfg.checkpoint_config["tag_validation"] == "FAIL"
    assert cfg.checkpoint_tag_validation_enabled and cfg.checkpoint_tag_validation_fail
    assert cfg.load_universal_checkpoint is True
    assert cfg.checkpoint_config.writer["type"] == "PYTHON"
    assert (cfg.aio_config.block_size, cfg.aio_config.thread_count) == (262144, 4)


#########################################
# Batch identity: train = micro * gas * world
#########################################


def _batch_config(train, micro, gas):
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    return {key: value for key, value in zip(keys, (train, micro, gas)) if value is not None}


@pytest.mark.parametrize(
    "train, micro, gas, world, expected",
    [
        (32, 4, None, 2, (32, 4, 32 // (4 * 2))),
        (32, None, 4, 2, (32, 32 // (4 * 2), 4)),
        (None, 4, 4, 2, (4 * 4 * 2, 4, 4)),
        (32, 4, 4, 2, (32, 4, 4)),
        (32, None, None, 2, (32, 32 // 2, 1)),
        (None, 4, None, 2, (4 * 2, 4, 1)),
        (24, 2, None, 3, (24, 2, 24 // (2 * 3))),
        (18, None, 3, 3, (18, 18 // (3 * 3), 3)),
        (None, 3, 2, 3, (3 * 2 * 3, 3, 2)),
        (12, None, None, 3, (12, 12 // 3, 1)),
        (None, 5, None, 3, (5 * 3, 5, 1)),
        (6, 6, 1, 1, (6, 6, 1)),
        (6, 1, None, 1, (6, 1, 6)),
    ],
)
def test_batch_identity(train, micro, gas, world, expected):
    cfg = DeepSpeedConfig(_batch_config(train, micro, gas), world_size=world)
    got = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    assert got == expected
    assert got[0] == got[1] * got[2] * world
    assert cfg.world_size == world
    assert resolve_batch_sizes(train, micro, gas, world) == expected


@pytest.mark.parametrize("train, micro, gas, world, fragment", [
    (30, 4, None, 2, "'gradient_accumulation_steps' cannot be derived"),
    (32, None, 3, 2, "'train_micro_batch_size_per_gpu' cannot be derived"),
    (7, None, None, 2, "'train_micro_batch_size_per_gpu' cannot be derived"),
    (24, 2, None, 5, "'gradient_accumulation_steps' cannot be derived"),
    (32, 4, 3, 2, "32 != 4 * 3 * 2"),
    (13, 2, 2, 3, "13 != 2 * 2 * 3"),
    (None, None, 4, 1, "only 'gradient_accumulation_steps'"),
    (None, None, None, 1, "none of them"),
])
def test_batch_identity_errors(train, micro, gas, world, fragment):
    with pytest.raises(DeepSpeedConfigError) as info:
        DeepSpeedConfig(_batch_config(train, micro, gas), world_size=world)
    assert fragment in str(info.value)
    assert "train_batch_size" in str(info.value)


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"])
@pytest.mark.parametrize("value", [0, -4, 2.5, True, "8"])
def test_batch_values_must_be_positive_ints(key, value):
    config = {"train_micro_batch_size_per_gpu": 1, key: value}
    with pytest.raises(DeepSpeedConfigError, match=f"'{key}'"):
        DeepSpeedConfig(config, world_size=1)


def test_world_size_from_mpu():

    class Mpu:

        def get_data_parallel_world_size(self):
            return 3

    cfg = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, mpu=Mpu())
    assert cfg.world_size == 3
    assert cfg.train_batch_size == 2 * 2 * 3


def test_world_size_defaults_to_one_without_process_group():
    assert not torch.distributed.is_initialized()
    cfg = DeepSpeedConfig({"train_batch_size": 4})
    assert (cfg.world_size, cfg.train_micro_batch_size_per_gpu) == (1, 4)


#########################################
# Validation errors: each names its key path and what is accepted
#########################################

Z = "zero_optimization"
# yapf: disable
ERROR_CASES = [
    ({f"{Z}.stage": 4}, f"{Z}.stage", "[0, 1, 2, 3]"),
    ({f"{Z}.stage": "2"}, f"{Z}.stage", "integer"),
    ({f"{Z}.stage": True}, f"{Z}.stage", "integer"),
    ({f"{Z}.contiguous_gradients": "yes"}, f"{Z}.contiguous_gradients", "bool"),
    ({f"{Z}.reduce_bucket_size": -1}, f"{Z}.reduce_bucket_size", ">= 0"),
    ({f"{Z}.reduce_bucket_size": True}, f"{Z}.reduce_bucket_size", "number"),
    ({f"{Z}.stage3_max_live_parameters": "1e9"}, f"{Z}.stage3_max_live_parameters", "number"),
    ({f"{Z}.offload_optimizer.device": "gpu"}, f"{Z}.offload_optimizer.device", "['none', 'cpu', 'nvme']"),
    ({f"{Z}.stage": 3, f"{Z}.offload_param.device": "disk"}, f"{Z}.offload_param.device", "['none', 'cpu', 'nvme']"),
    ({f"{Z}.stage": 3, f"{Z}.offload_param.device": "nvme"}, f"{Z}.offload_param.nvme_path", "required"),
    ({f"{Z}.stage": 2, f"{Z}.offload_optimizer": {"device": "nvme"}}, f"{Z}.offload_optimizer.nvme_path", "required"),
    ({f"{Z}.stage": 2, f"{Z}.offload_optimizer": {"device": "cpu", "ratio": 0.5}}, f"{Z}.offload_optimizer.ratio",
     "stage' 3"),
    ({f"{Z}.stage": 3, f"{Z}.offload_optimizer.ratio": 1.5}, f"{Z}.offload_optimizer.ratio", "<= 1.0"),
    ({f"{Z}.offload_optimizer.pin_memory": 1}, f"{Z}.offload_optimizer.pin_memory", "bool"),
    ({f"{Z}.prefetch_bucket_size": 1, f"{Z}.stage3_prefetch_bucket_size": 2}, f"{Z}.stage3_prefetch_bucket_size",
     "same option"),
    ({f"{Z}.cpu_offload": True, f"{Z}.offload_optimizer.device": "cpu"}, f"{Z}.cpu_offload", f"{Z}.offload_optimizer"),
    ({f"{Z}.leaf_module.classes": 3}, f"{Z}.leaf_module.classes", "list of strings"),
    ({Z: []}, Z, "dict"),
    ({"fp16.enabled": True, "bf16.enabled": True}, "fp16.enabled", "bf16.enabled"),
    ({"fp16.enabled": True, "bfloat16.enabled": True}, "fp16.enabled", "bfloat16.enabled"),
    ({"bf16.enabled": True, "bfloat16.enabled": True}, "bfloat16", "bf16"),
    ({"fp16.loss_scale": -1}, "fp16.loss_scale", ">= 0"),
    ({"fp16.enabled": "true"}, "fp16.enabled", "bool"),
    ({"fp16.initial_scale_power": 1.5}, "fp16.initial_scale_power", "integer"),
    ({"fp16.enabled": True, "fp16.hysteresis": 0}, "fp16.hysteresis", "> 0"),
    ({"fp16.enabled": True, "fp16.min_loss_scale": 0}, "fp16.min_loss_scale", "> 0"),
    ({"fp16": 1}, "fp16", "dict"),
    ({"bf16.bf16_optimizer_states": True}, "bf16.bf16_optimizer_states", "bf16.bf16_master_weights_and_grads"),
    ({"bf16.bf16_master_weights_and_grads": True}, "bf16.bf16_master_weights_and_grads", f"{Z}.stage"),
    ({"fp16.fp16_master_weights_and_grads": True}, "fp16.fp16_master_weights_and_grads", f"{Z}.stage"),
    ({"gradient_allreduce_op": "max"}, "gradient_allreduce_op", "Invalid gradient_allreduce_op"),
    ({"gradient_allreduce_op": "max"}, "gradient_allreduce_op", "['mean', 'sum']"),
    ({"gradient_allreduce_op": "sum", f"{Z}.stage": 3}, "gradient_allreduce_op", "not supported with ZeRO stage 3"),
    ({"gradient_allreduce_op": "sum", f"{Z}.stage": 2, f"{Z}.zenflow": {}, f"{Z}.offload_optimizer.device": "cpu"},
     "gradient_allreduce_op", "not supported with ZenFlow"),
    ({"gradient_allreduce_op": "sum", f"{Z}.stage": 1, "compile.deepcompile": True}, "gradient_allreduce_op",
     "not supported with DeepCompile"),
    ({"scheduler.type": "Linear"}, "scheduler.type", "WarmupCosineLR"),
    ({"optimizer.type": "Adamax2"}, "optimizer.type", "onebitadam"),
    ({"optimizer.type": 3}, "optimizer.type", "adamw"),
    ({"optimizer.type": "Adam", "optimizer.params": [0.1]}, "optimizer.params", "dict"),
    ({"optimizer.params.lr": 0.1}, "optimizer.type", "required"),
    ({"communication_data_type": "int8"}, "communication_data_type", "'fp32', 'fp16', 'bf16'"),
    ({"data_types.grad_accum_dtype": "fp64"}, "data_types.grad_accum_dtype", "'bfloat16'"),
    ({"gradient_clipping": -1.0}, "gradient_clipping", ">= 0.0"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping", "number"),
    ({"gradient_clipping": float("nan")}, "gradient_clipping", "finite"),
    ({"steps_per_print": 0}, "steps_per_print", ">= 1"),
    ({"gradient_predivide_factor": 0}, "gradient_predivide_factor", "> 0.0"),
    ({"wall_clock_breakdown": 1}, "wall_clock_breakdown", "bool"),
    ({"prescale_gradients": "no"}, "prescale_gradients", "bool"),
    ({"managed_gradient_accumulation": "false"}, "managed_gradient_accumulation", "bool"),
    ({"zero_allow_untested_optimizer": 1}, "zero_allow_untested_optimizer", "bool"),
    ({"activation_checkpointing.partition_activations": 1}, "activation_checkpointing.partition_activations", "bool"),
    ({"activation_checkpointing.number_checkpoints": -1}, "activation_checkpointing.number_checkpoints", ">= 0"),
    ({"checkpoint.tag_validation": "Maybe"}, "checkpoint.tag_validation", "['WARN', 'IGNORE', 'FAIL']"),
    ({"checkpoint.writer.type": "slow"}, "checkpoint.writer.type", "['mock', 'python', 'fast']"),
    ({"aio.block_size": 0}, "aio.block_size", ">= 1"),
    ({"tensorboard": "yes"}, "tensorboard", "dict"),
    ({"wandb": ["enabled"]}, "wandb", "dict"),
    ({"csv_monitor": 1}, "csv_monitor", "dict"),
    ({"elasticity.enabled": True}, "elasticity.enabled", "not supported"),
]
# yapf: enable


@pytest.mark.parametrize("flat, path, allowed", ERROR_CASES)
def test_validation_errors(flat, path, allowed):
    with pytest.raises(DeepSpeedConfigError) as info:
        make(flat)
    message = str(info.value)
    assert f"'{path}" in message, message
    assert allowed in message, message
    assert isinstance(info.value, ValueError)


#########################################
# "auto" values
#########################################

# yapf: disable
AUTO_CASES = [
    ({"train_batch_size": "auto"}, "train_batch_size"),
    ({"gradient_clipping": "auto"}, "gradient_clipping"),
    ({"fp16.enabled": "auto"}, "fp16.enabled"),
    ({"bf16.enabled": "Auto"}, "bf16.enabled"),
    ({"optimizer.type": "AdamW", "optimizer.params.lr": "auto"}, "optimizer.params.lr"),
    ({"optimizer.type": "AdamW", "optimizer.params.betas": [0.9, "auto"]}, "optimizer.params.betas[1]"),
    ({"scheduler.type": "WarmupLR", "scheduler.params.warmup_max_lr": "auto"}, "scheduler.params.warmup_max_lr"),
    ({"my_framework_section.nested.value": "auto"}, "my_framework_section.nested.value"),
]
# yapf: enable


@pytest.mark.parametrize("flat, path", AUTO_CASES)
def test_auto_anywhere_raises(flat, path):
    with pytest.raises(DeepSpeedConfigError) as info:
        make(flat)
    message = str(info.value)
    assert f"config key '{path}' is 'auto'" in message
    assert "deepspeed.initialize" in message


def test_auto_in_zero_optimization_is_the_default():
    """Upstream's zero_optimization models drop an exact "auto": the key keeps its default (OpenRLHF's configs)."""
    cfg = make({
        f"{Z}.stage": 3,
        f"{Z}.stage3_prefetch_bucket_size": "auto",
        f"{Z}.offload_optimizer.device": "auto",
        f"{Z}.reduce_bucket_size": "auto"
    })
    default = make({f"{Z}.stage": 3})
    for key in ("prefetch_bucket_size", "reduce_bucket_size"):
        assert getattr(cfg.zero_config, key) == getattr(default.zero_config, key), key
    assert cfg.zero_config.offload_optimizer.device == "none"
    assert cfg._param_dict["zero_optimization"]["reduce_bucket_size"] == "auto"  # the user's dict is kept


def test_auto_where_upstream_gives_it_a_meaning():
    assert find_auto_values({"pipeline": {"stages": "auto"}}) is None
    assert find_auto_values({"pipeline": {"stages": "auto", "x": ["auto"]}}) == "pipeline.x[0]"
    assert make({"pipeline.stages": "auto"}).train_batch_size == 8


#########################################
# Unknown keys
#########################################

# yapf: disable
UNKNOWN_KEY_CASES = [
    ({f"{Z}.bucket": 1}, f"{Z}.bucket", "reduce_bucket_size"),
    ({f"{Z}.offload_optimizer.pinned": True}, f"{Z}.offload_optimizer.pinned", "pin_memory"),
    ({f"{Z}.stage": 3, f"{Z}.offload_param.max_in_gpu": 1}, f"{Z}.offload_param.max_in_gpu", "max_in_cpu"),
    ({"fp16.scale": 1}, "fp16.scale", "initial_scale_power"),
    ({"bf16.enable": True}, "bf16.enable", "enabled"),
    ({"bfloat16.enable": True}, "bfloat16.enable", "immediate_grad_update"),
    ({"data_types.grad_dtype": "fp32"}, "data_types.grad_dtype", "grad_accum_dtype"),
    ({"optimizer.type": "Adam", "optimizer.lr": 0.1}, "optimizer.lr", "params"),
    ({"scheduler.type": "WarmupLR", "scheduler.warmup_num_steps": 3}, "scheduler.warmup_num_steps", "params"),
    ({"activation_checkpointing.partition": True}, "activation_checkpointing.partition", "partition_activations"),
    ({"checkpoint.tag": "x"}, "checkpoint.tag", "tag_validation"),
    ({"checkpoint.writer.kind": "fast"}, "checkpoint.writer.kind", "io_buffer_size"),
    ({"aio.depth": 2}, "aio.depth", "queue_depth"),
    ({"torch_autocast.enable": True}, "torch_autocast.enable", "lower_precision_safe_modules"),
]
# yapf: enable


@pytest.mark.parametrize("flat, path, a_valid_key", UNKNOWN_KEY_CASES)
def test_unknown_section_key_raises(flat, path, a_valid_key):
    with pytest.raises(DeepSpeedConfigError) as info:
        make(flat)
    message = str(info.value)
    assert f"unknown config key '{path}'" in message
    assert a_valid_key in message


def test_unknown_top_level_key_only_warns(config_log):
    cfg = make({"my_unknown_key.x": 1, "flops_profiler.enabled": False, "comms_logger": {}})
    assert cfg.train_batch_size == 8
    warnings = [text for level, text in config_log if level == logging.WARNING]
    assert len(warnings) == 1
    assert "my_unknown_key" in warnings[0]
    assert "flops_profiler" not in warnings[0] and "comms_logger" not in warnings[0]


def test_known_config_does_not_warn(config_log):
    DeepSpeedConfig(FULL, world_size=1)
    assert [text for level, text in config_log if level >= logging.WARNING] == []


def test_print_and_repr(config_log):
    cfg = make({f"{Z}.stage": 2})
    cfg.print("DeepSpeedEngine configuration")
    text = "\n".join(message for _, message in config_log)
    assert "train_micro_batch_size_per_gpu" in text and "zero_optimization_stage" in text
    assert '"train_batch_size": 8' in text
    assert "train_batch_size=8" in repr(cfg) and "zero_optimization_stage=2" in repr(cfg)
