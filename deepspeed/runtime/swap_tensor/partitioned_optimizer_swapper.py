# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``PartitionedOptimizerSwapper``: this package's optimizer tier,
:class:`~deepspeed.runtime.swap_tensor.optimizer_swap.OptimizerStateSwap` (built by the offloaded step with
``offload_optimizer.device: nvme``, on ZeRO 1, 2 and 3; its constructor is this package's,
``(host_step, page_table, swap_config, rank)``). The engine's object is ``engine.optimizer.stage.host_step.swap``.
"""

from deepspeed.runtime.swap_tensor.optimizer_swap import OptimizerStateSwap

PartitionedOptimizerSwapper = OptimizerStateSwap
