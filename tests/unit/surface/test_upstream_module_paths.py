# SPDX-License-Identifier: Apache-2.0
"""Every module path this package shares with upstream DeepSpeed 0.19.8 imports, from its own file.

Code written against upstream imports these paths directly (``from deepspeed.runtime.zero.stage3 import ...``), so
a module of this package may move between subpackages only where upstream has no module of that name. The list is
the intersection of upstream 0.19.8's module tree with this package's, taken when the runtime was grouped into
subpackages; a path is dropped from it only together with an alias that keeps it importable.
"""

import importlib
import os

import pytest

import deepspeed

UPSTREAM_MODULE_PATHS = (
    'deepspeed',
    'deepspeed.accelerator', 'deepspeed.accelerator.abstract_accelerator',
    'deepspeed.accelerator.cpu_accelerator', 'deepspeed.accelerator.cuda_accelerator',
    'deepspeed.accelerator.hpu_accelerator', 'deepspeed.accelerator.klxpu_accelerator',
    'deepspeed.accelerator.mlu_accelerator', 'deepspeed.accelerator.mps_accelerator',
    'deepspeed.accelerator.npu_accelerator', 'deepspeed.accelerator.real_accelerator',
    'deepspeed.accelerator.sdaa_accelerator', 'deepspeed.accelerator.supa_accelerator',
    'deepspeed.accelerator.xpu_accelerator',
    'deepspeed.checkpoint', 'deepspeed.checkpoint.constants', 'deepspeed.checkpoint.deepspeed_checkpoint',
    'deepspeed.checkpoint.ds_to_universal', 'deepspeed.checkpoint.reshape_3d_utils',
    'deepspeed.checkpoint.reshape_meg_2d', 'deepspeed.checkpoint.reshape_utils',
    'deepspeed.checkpoint.universal_checkpoint', 'deepspeed.checkpoint.utils',
    'deepspeed.checkpoint.zero_checkpoint',
    'deepspeed.comm', 'deepspeed.comm.comm', 'deepspeed.comm.config', 'deepspeed.comm.reduce_op',
    'deepspeed.constants',
    'deepspeed.env_report',
    'deepspeed.git_version_info',
    'deepspeed.launcher', 'deepspeed.launcher.constants', 'deepspeed.launcher.launch',
    'deepspeed.launcher.multinode_runner', 'deepspeed.launcher.runner',
    'deepspeed.module_inject', 'deepspeed.module_inject.autotp_config', 'deepspeed.module_inject.layers',
    'deepspeed.module_inject.tp_plan_converter', 'deepspeed.module_inject.tp_shard',
    'deepspeed.moe', 'deepspeed.moe.experts', 'deepspeed.moe.fused_expert_layout', 'deepspeed.moe.layer',
    'deepspeed.moe.mappings', 'deepspeed.moe.sharded_moe', 'deepspeed.moe.utils',
    'deepspeed.monitor', 'deepspeed.monitor.comet', 'deepspeed.monitor.config',
    'deepspeed.monitor.csv_monitor', 'deepspeed.monitor.monitor', 'deepspeed.monitor.tensorboard',
    'deepspeed.monitor.utils', 'deepspeed.monitor.wandb',
    'deepspeed.nvme',
    'deepspeed.ops', 'deepspeed.ops.adagrad', 'deepspeed.ops.adagrad.cpu_adagrad', 'deepspeed.ops.adam',
    'deepspeed.ops.adam.cpu_adam', 'deepspeed.ops.adam.fused_adam', 'deepspeed.ops.adam.multi_tensor_apply',
    'deepspeed.ops.adam.zenflow_torch_adam', 'deepspeed.ops.aio', 'deepspeed.ops.lamb', 'deepspeed.ops.lion',
    'deepspeed.ops.lion.cpu_lion', 'deepspeed.ops.lion.fused_lion', 'deepspeed.ops.op_builder',
    'deepspeed.ops.op_builder.all_ops', 'deepspeed.ops.op_builder.async_io', 'deepspeed.ops.op_builder.builder',
    'deepspeed.pipe',
    'deepspeed.profiling', 'deepspeed.profiling.config', 'deepspeed.profiling.flops_profiler',
    'deepspeed.profiling.flops_profiler.profiler',
    'deepspeed.runtime', 'deepspeed.runtime.activation_checkpointing',
    'deepspeed.runtime.activation_checkpointing.checkpointing',
    'deepspeed.runtime.activation_checkpointing.offload_activations', 'deepspeed.runtime.base_optimizer',
    'deepspeed.runtime.bf16_optimizer', 'deepspeed.runtime.checkpoint_engine',
    'deepspeed.runtime.checkpoint_engine.checkpoint_engine',
    'deepspeed.runtime.checkpoint_engine.datastates_checkpoint_engine',
    'deepspeed.runtime.checkpoint_engine.decoupled_checkpoint_engine',
    'deepspeed.runtime.checkpoint_engine.fast_checkpoint_engine',
    'deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine', 'deepspeed.runtime.checkpoint_engine.utils',
    'deepspeed.runtime.comm', 'deepspeed.runtime.comm.coalesced_collectives', 'deepspeed.runtime.compiler',
    'deepspeed.runtime.config', 'deepspeed.runtime.config_utils', 'deepspeed.runtime.constants',
    'deepspeed.runtime.dataloader', 'deepspeed.runtime.engine', 'deepspeed.runtime.fp16',
    'deepspeed.runtime.fp16.fused_optimizer', 'deepspeed.runtime.fp16.loss_scaler',
    'deepspeed.runtime.fp16.unfused_optimizer', 'deepspeed.runtime.keep_in_fp32',
    'deepspeed.runtime.lr_schedules', 'deepspeed.runtime.pipe', 'deepspeed.runtime.pipe.engine',
    'deepspeed.runtime.pipe.module', 'deepspeed.runtime.pipe.p2p', 'deepspeed.runtime.pipe.schedule',
    'deepspeed.runtime.pipe.topology', 'deepspeed.runtime.precision_config', 'deepspeed.runtime.python_gc',
    'deepspeed.runtime.sequence_parallel', 'deepspeed.runtime.sequence_parallel.parallel_state_sp',
    'deepspeed.runtime.sequence_parallel.ulysses_sp', 'deepspeed.runtime.sparse_tensor',
    'deepspeed.runtime.swap_tensor', 'deepspeed.runtime.swap_tensor.aio_config',
    'deepspeed.runtime.swap_tensor.async_swapper', 'deepspeed.runtime.swap_tensor.constants',
    'deepspeed.runtime.swap_tensor.optimizer_utils',
    'deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper',
    'deepspeed.runtime.swap_tensor.partitioned_param_swapper',
    'deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper', 'deepspeed.runtime.swap_tensor.utils',
    'deepspeed.runtime.tensor_parallel', 'deepspeed.runtime.tensor_parallel.config',
    'deepspeed.runtime.tensor_parallel.init_utils', 'deepspeed.runtime.tensor_parallel.tp_manager',
    'deepspeed.runtime.torch_autocast', 'deepspeed.runtime.utils', 'deepspeed.runtime.zenflow',
    'deepspeed.runtime.zenflow.zenflow_config', 'deepspeed.runtime.zenflow.zenflow_utils',
    'deepspeed.runtime.zero', 'deepspeed.runtime.zero.config', 'deepspeed.runtime.zero.leaf_module_config',
    'deepspeed.runtime.zero.linear', 'deepspeed.runtime.zero.muon',
    'deepspeed.runtime.zero.muon.muon_optimizer', 'deepspeed.runtime.zero.muon.original_muon',
    'deepspeed.runtime.zero.offload_config', 'deepspeed.runtime.zero.offload_states',
    'deepspeed.runtime.zero.parameter_offload', 'deepspeed.runtime.zero.partition_parameters',
    'deepspeed.runtime.zero.stage3', 'deepspeed.runtime.zero.stage_1_and_2', 'deepspeed.runtime.zero.tiling',
    'deepspeed.runtime.zero.utils',
    'deepspeed.sequence', 'deepspeed.sequence.layer',
    'deepspeed.utils', 'deepspeed.utils.comms_logging', 'deepspeed.utils.groups',
    'deepspeed.utils.init_on_device', 'deepspeed.utils.logging', 'deepspeed.utils.module_utils',
    'deepspeed.utils.numa', 'deepspeed.utils.nvtx', 'deepspeed.utils.pin_memory',
    'deepspeed.utils.pin_memory_tracker', 'deepspeed.utils.tensor_fragment', 'deepspeed.utils.timer',
    'deepspeed.utils.torch', 'deepspeed.utils.z3_leaf_module', 'deepspeed.utils.zero_to_fp32',
)


@pytest.mark.parametrize("path", UPSTREAM_MODULE_PATHS)
def test_upstream_module_path_imports_from_its_own_file(path):
    module = importlib.import_module(path)
    assert module.__name__ == path
    root = os.path.dirname(os.path.dirname(deepspeed.__file__))
    relative = os.path.relpath(module.__file__, root)
    expected = path.replace(".", os.sep)
    assert relative in (expected + ".py", os.path.join(expected, "__init__.py")), (path, relative)


def test_the_list_has_no_duplicates_and_is_sorted():
    assert list(UPSTREAM_MODULE_PATHS) == sorted(set(UPSTREAM_MODULE_PATHS))
