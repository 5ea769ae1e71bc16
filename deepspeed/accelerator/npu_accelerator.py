# SPDX-License-Identifier: Apache-2.0
"""Upstream's Huawei Ascend (NPU) accelerator: not built (see ``other_accelerators.py``)."""

from .abstract_accelerator import DeepSpeedAccelerator  # noqa: F401
from .other_accelerators import not_built_accelerator

NPU_Accelerator = not_built_accelerator("NPU_Accelerator", "Huawei Ascend (NPU)", __name__, "npu", "hccl")
