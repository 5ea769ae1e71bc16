# SPDX-License-Identifier: Apache-2.0
"""Every upstream module path of this package's surface imports and holds upstream's names.

The table is written out from upstream 0.19.8's module tree (the names code written against upstream imports).
A name marked here as not built must raise NotImplementedError naming its feature when used; that is checked
in test_not_built.py.
"""

import importlib

import pytest

SURFACE = {
    "deepspeed": ["OnDevice", "DeepSpeedOptimizer", "DeepSpeedDataLoader", "DeepSpeedEngine", "initialize"],
    "deepspeed.runtime.precision_config": [
        "FP16", "BFLOAT16", "BFLOAT16_OLD", "INITIAL_LOSS_SCALE", "SCALE_WINDOW", "DELAYED_SHIFT",
        "CONSECUTIVE_HYSTERESIS", "MIN_LOSS_SCALE", "DeepSpeedFP16Config", "DeepSpeedBF16Config", "get_float16_config",
        "get_bfloat16_config"
    ],
    "deepspeed.runtime.utils": [
        "partition_uniform", "partition_balanced", "prefix_sum_inc", "count_used_parameters_in_backward",
        "check_internal_apis_for_count_used_parameters", "move_to_device", "copy_to_device", "noop_context",
        "noop_decorator", "see_memory_usage", "set_random_seed", "get_global_norm", "clip_grad_norm_",
        "get_global_norm_of_tensors", "clip_tensors_by_global_norm", "has_inf_or_nan", "is_invalid_grad_norm",
        "combine_grad_norm_groups", "CheckOverflow", "DummyOptim", "PartitionedTensor", "TLinear",
        "align_dense_tensors", "get_grad_zeros", "get_weight_norm", "get_flattened_grad_norm", "get_only_unique_item",
        "call_to_str", "maybe_loss_for_backward", "compare_tensors_in_structures", "get_inactive_params",
        "mask_nan_or_inf_with_val_inplace", "get_tensor_bytes", "filter_empty_parameters",
        "is_model_parallel_parameter", "empty_cache", "ensure_directory_exists", "get_checkpoint_folder_size",
        "memory_status", "get_ma_status", "is_optimized_parameter", "register_output_backward_hooks",
        "OutputBackwardHookManager", "offload_adam_states", "reload_adam_states", "PIPE_REPLICATED"
    ],
    "deepspeed.utils": [
        "RepeatingLoader", "OnDevice", "safe_update_full_grad_vectorized", "set_log_level_from_string",
        "log_dist_once", "instrument_w_nvtx", "get_numactl_cmd", "recursive_getattr", "recursive_setattr",
        "get_caller_func"
    ],
    "deepspeed.utils.torch":
    ["required_torch_version", "register_grad_hook", "jit_script_compat", "is_functorch_transforming"],
    "deepspeed.utils.numa":
    ["get_numa_cores", "check_for_numactl_pkg", "parse_range", "parse_range_list", "get_numactl_cmd"],
    "deepspeed.utils.nvtx": ["instrument_w_nvtx", "enable_nvtx", "DEEPSPEED_NVTX_DOMAIN"],
    "deepspeed.utils.pin_memory":
    ["NativePinnedMemory", "get_native_pinned_memory", "get_active_native_pinned_memory"],
    "deepspeed.utils.pin_memory_tracker": ["track_pinned_memory", "pinned_memory_summary"],
    "deepspeed.utils.init_on_device": ["OnDevice"],
    "deepspeed.utils.module_utils": ["recursive_getattr", "recursive_setattr"],
    "deepspeed.runtime.bf16_optimizer": ["BF16_Optimizer"],
    "deepspeed.runtime.fp16.fused_optimizer": ["FP16_Optimizer"],
    "deepspeed.runtime.fp16.unfused_optimizer": ["FP16_UnfusedOptimizer"],
    "deepspeed.runtime.zero": [
        "Init", "GatheredParameters", "ZeroParamStatus", "ZeroParamType", "DeepSpeedTensorOverride",
        "register_external_parameter", "DeepSpeedZeRoOffload", "TiledLinear", "TiledLinearReturnBias",
        "unwrap_model_for_generation", "utils"
    ],
    "deepspeed.runtime.zero.utils": [
        "ZeRORuntimeException", "ZERO_SUPPORTED_OPTIMIZERS", "is_zero_supported_optimizer", "apply_to_tensors_only",
        "is_builtin_type", "isinstance_namedtuple", "is_zero_param", "get_lst_from_rank0",
        "assert_ints_same_as_other_ranks", "get_mapping_to_flat_buffer", "defragment", "get_norm_dtype"
    ],
    "deepspeed.runtime.zero.linear": ["LinearFunctionForZeroStage3", "LinearModuleForZeroStage3", "zero3_linear_wrap"],
    "deepspeed.runtime.zero.tiling": ["TiledLinear", "TiledLinearReturnBias", "split_tensor_along_last_dim"],
    "deepspeed.runtime.zero.parameter_offload":
    ["DeepSpeedZeRoOffload", "partitioned_param_data_shape", "DEFAULT_TENSOR_OVERRIDES", "FWD_MODULE_STACK"],
    "deepspeed.runtime.zero.offload_states": [
        "offload_optimizer_states", "reload_optimizer_states", "unpin_offloaded_optimizer_states",
        "offload_adam_states", "reload_adam_states", "get_state_devices", "OffloadStateTypeEnum"
    ],
    "deepspeed.runtime.zero.leaf_module_config": [
        "DeepSpeedZeroLeafModuleConfig", "DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES",
        "DEFAULT_LEAF_MODULE_NAME_SUFFIXES"
    ],
    "deepspeed.runtime.zero.stage_1_and_2": ["DeepSpeedZeroOptimizer"],
    "deepspeed.runtime.zero.stage3": ["DeepSpeedZeroOptimizer_Stage3", "unwrap_model_for_generation"],
    "deepspeed.runtime.zero.partition_parameters": [
        "MultipleAllGatherHandles", "InsertPostInitMethodToModuleSubClasses", "partitioned_param_data_shape",
        "ZeroParamType", "DeepSpeedTensorOverride", "DEFAULT_TENSOR_OVERRIDES", "Init", "GatheredParameters",
        "zero3_linear_wrap", "_contradicting_single_rank_pg_error", "CUDAQuantizer"
    ],
    # upstream's optional-kernel flags (never used here) and helpers its tests import
    "deepspeed.sequence.layer": ["apply_rotary_pos_emb", "_rotate_half", "_torchembed_available"],
    "deepspeed.moe.sharded_moe": ["TUTEL_INSTALLED", "_route_slots", "_sparse_encode", "_sparse_decode"],
    "deepspeed.utils.timer": ["trim_mean", "SynchronizedWallClockTimer", "ThroughputTimer"],
    "deepspeed.utils.groups": ["_get_expert_parallel_ranks"],
    "deepspeed.runtime.zero.config": ["DeepSpeedZeroConfig", "ZeroStageEnum"],
    "deepspeed.runtime.torch_autocast": [
        "LOWER_PRECISION_SAFE_MODULES", "PARAM_COMM_DTYPE_ATTR_NAME", "init_autocast_params",
        "is_autocast_initialized", "get_default_autocast_lower_precision_modules", "get_autocast_dtype",
        "has_comm_dtype", "get_comm_dtype", "get_all_comm_dtypes", "sort_dtypes", "autocast_if_enabled"
    ],
    "deepspeed.runtime.comm.coalesced_collectives":
    ["reduce_scatter_coalesced", "all_to_all_quant_reduce", "all_to_all_loco_quant_reduce"],
    "deepspeed.runtime.checkpoint_engine": [
        "CheckpointEngine", "CheckpointCommitInfo", "TorchCheckpointEngine", "FastCheckpointEngine",
        "DecoupledCheckpointEngine", "DataStatesCheckpointEngine", "create_checkpoint_engine"
    ],
    "deepspeed.runtime.checkpoint_engine.checkpoint_engine": ["CheckpointEngine", "CheckpointCommitInfo"],
    "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine": ["TorchCheckpointEngine"],
    "deepspeed.runtime.activation_checkpointing.offload_activations": [
        "CheckpointHiddenStatesOffload", "CheckpointActivationOffloadStats",
        "get_checkpoint_hidden_states_offloading_ctx_manager"
    ],
    "deepspeed.runtime.progressive_layer_drop": ["ProgressiveLayerDrop"],
    "deepspeed.runtime.sparse_tensor": ["SparseTensor"],
    "deepspeed.runtime.swap_tensor": ["MIN_SWAPPABLE_BYTES"],
    "deepspeed.runtime.swap_tensor.aio_config": ["get_aio_config", "AIO_DEFAULT_DICT"],
    "deepspeed.runtime.swap_tensor.constants": ["AIO", "AIO_BLOCK_SIZE", "AIO_QUEUE_DEPTH", "AIO_USE_GDS"],
    "deepspeed.runtime.swap_tensor.utils": [
        "MIN_AIO_BYTES", "AIO_ALIGNED_BYTES", "SwapBuffer", "SwapBufferPool", "SwapBufferManager", "get_sized_buffer",
        "get_sized_buffers"
    ],
    "deepspeed.runtime.swap_tensor.async_swapper": ["AsyncTensorSwapper"],
    "deepspeed.runtime.swap_tensor.optimizer_utils": ["OptimizerSwapper"],
    "deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper": ["PartitionedOptimizerSwapper"],
    "deepspeed.runtime.swap_tensor.partitioned_param_swapper":
    ["AsyncPartitionedParameterSwapper", "PartitionedParamStatus"],
    "deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper": ["PipelinedOptimizerSwapper"],
    "deepspeed.runtime.tensor_parallel": ["AUTOTP_MODE", "get_tensor_parallel_config", "TpTrainingManager"],
    "deepspeed.runtime.tensor_parallel.init_utils":
    ["load_ds_config", "record_tp_model_init_args", "merge_tp_model_init_into_config", "tp_model_init"],
    "deepspeed.runtime.config": [
        "ADAM_OPTIMIZER", "ADAMW_OPTIMIZER", "get_gradient_clipping", "get_log_level", "DeepSpeedConfig",
        "DeepSpeedConfigError", "get_train_batch_size", "get_optimizer_name", "get_scheduler_name",
        "get_checkpoint_tag_validation_mode", "LOG_LEVEL", "BUFFER_DTYPE"
    ],
    "deepspeed.runtime.config_utils": [
        "DeepSpeedConfigModel", "get_scalar_param", "get_list_param", "get_dict_param", "get_config_default",
        "dict_raise_error_on_duplicate_keys", "pp_int", "ScientificNotationEncoder", "DeepSpeedConfigObject"
    ],
    "deepspeed.runtime.dataloader": ["RepeatingLoader", "DeepSpeedDataLoader"],
    "deepspeed.ops.adam": ["FusedAdam", "DeepSpeedCPUAdam", "ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3"],
    "deepspeed.ops.adam.multi_tensor_apply": ["MultiTensorApply"],
    "deepspeed.ops.aio": ["AsyncIOBuilder"],
    "deepspeed.nvme": ["ds_io_main", "sweep_main", "generate_main", "parse_sweep_arguments"],
    "deepspeed.ops.op_builder": ["FusedAdamBuilder", "AsyncIOBuilder", "CPUAdamBuilder", "PinMemoryBuilder"],
}


@pytest.mark.parametrize("path", sorted(SURFACE))
def test_module_imports_with_upstream_names(path):
    module = importlib.import_module(path)
    missing = [name for name in SURFACE[path] if not hasattr(module, name)]
    assert not missing, f"{path} lacks {missing}"


def test_stage_optimizer_classes_are_the_returned_ones():
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.engine_parts.optimizer import EngineOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    for cls in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        assert issubclass(cls, EngineOptimizer) and issubclass(cls, ZeROOptimizer)
    assert not issubclass(DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)
    with pytest.raises(NotImplementedError, match="deepspeed.initialize"):
        DeepSpeedZeroOptimizer(None, None)
