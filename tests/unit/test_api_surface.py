# SPDX-License-Identifier: Apache-2.0
"""What scripts and frameworks import from the package resolves after a bare ``import deepspeed``."""

import importlib

import pytest
from packaging.version import Version

import deepspeed

ATTRIBUTES = [
    "zero", "comm", "runtime.lr_schedules.VALID_LR_SCHEDULES", "utils.logging", "utils.logger",
    "checkpointing.configure", "checkpointing.checkpoint", "DeepSpeedEngine", "DeepSpeedConfig", "initialize",
    "init_distributed", "zero.Init", "zero.GatheredParameters"
]
IMPORTS = {
    "deepspeed.checkpointing": ["configure", "checkpoint"],
    "deepspeed.runtime.base_optimizer": ["DeepSpeedOptimizer", "ZeROOptimizer"],
    "deepspeed.checkpoint.utils": ["clone_tensors_for_torch_save"],
    "deepspeed.launcher.runner": ["DEEPSPEED_ENVIRONMENT_NAME", "main"],
    "deepspeed.ops.adam": ["FusedAdam", "DeepSpeedCPUAdam"],
    "deepspeed.runtime.zero.partition_parameters":
    ["zero_wrapper_for_fp_tensor_constructor", "_orig_torch_arange", "get_accelerator", "ZeroParamStatus"],
    "deepspeed.utils": [
        "safe_get_full_grad", "safe_set_full_grad", "safe_get_full_fp32_param", "safe_set_full_fp32_param",
        "safe_get_full_optimizer_state", "safe_get_local_grad", "safe_get_local_fp32_param", "set_z3_leaf_modules",
        "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"
    ],
    "deepspeed.utils.zero_to_fp32": [
        "get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
        "load_state_dict_from_zero_checkpoint"
    ],
}
ENGINE_METHODS = ("forward backward scale step zero_grad is_gradient_accumulation_boundary "
                  "set_gradient_accumulation_boundary no_sync coalesce_grad_reduction was_step_applied "
                  "get_global_grad_norm get_lr train eval destroy gradient_accumulation_steps "
                  "train_micro_batch_size_per_gpu train_batch_size zero_optimization_stage fp16_enabled "
                  "bfloat16_enabled managed_gradient_accumulation save_checkpoint load_checkpoint save_16bit_model "
                  "zero_gather_16bit_weights_on_model_save _zero3_consolidated_16bit_state_dict").split()


@pytest.mark.parametrize("path", ATTRIBUTES)
def test_attribute_resolves(path):
    obj = deepspeed
    for part in path.split("."):
        obj = getattr(obj, part)


@pytest.mark.parametrize("module", sorted(IMPORTS))
def test_import(module):
    mod = importlib.import_module(module)
    for name in IMPORTS[module]:
        assert hasattr(mod, name), f"{module}.{name}"


def test_version_is_one_frameworks_accept():
    assert Version(deepspeed.__version__) >= Version("0.18.2")


@pytest.mark.parametrize("method", ENGINE_METHODS)
def test_engine_method(method):
    assert callable(getattr(deepspeed.DeepSpeedEngine, method))
