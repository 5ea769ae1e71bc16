# SPDX-License-Identifier: Apache-2.0
"""Upstream's ZeRO-3 parameter swapper (NVMe): not built. ``PartitionedParamStatus`` is upstream's enum of a
swapped parameter's state; constructing ``AsyncPartitionedParameterSwapper`` raises ``NotImplementedError``."""

from enum import Enum

from deepspeed.runtime.not_built import not_built_class


class PartitionedParamStatus(Enum):
    AVAILABLE = 1  # the partition is in memory
    NOT_AVAILABLE = 2  # the partition is on another device (NVMe)
    INFLIGHT = 3  # the partition is being read


AsyncPartitionedParameterSwapper = not_built_class("AsyncPartitionedParameterSwapper",
                                                   "NVMe parameter swapping",
                                                   module=__name__)
