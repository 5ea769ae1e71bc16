# SPDX-License-Identifier: Apache-2.0
"""Upstream's ZeRO-3 parameter swapper names. ``AsyncPartitionedParameterSwapper`` is this package's parameter tier,
:class:`~deepspeed.runtime.swap_tensor.param_swap.ParamShardSwap` (built by the ZeRO-3 stage with
``offload_param.device: nvme``; its constructor is this package's, ``(stage, page_table, swap_config, rank)``), so
``isinstance`` checks and type hints written for upstream see the object the engine holds
(``engine.optimizer.stage.param_tier``). ``PartitionedParamStatus`` is upstream's enum of a swapped parameter's state.
"""

from enum import Enum

from deepspeed.runtime.swap_tensor.param_swap import ParamShardSwap


class PartitionedParamStatus(Enum):
    AVAILABLE = 1  # the partition is in memory
    NOT_AVAILABLE = 2  # the partition is on another device (NVMe)
    INFLIGHT = 3  # the partition is being read


AsyncPartitionedParameterSwapper = ParamShardSwap
