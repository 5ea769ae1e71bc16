# SPDX-License-Identifier: Apache-2.0
"""Upstream's Intel XPU accelerator: not built (see ``other_accelerators.py``)."""

from .abstract_accelerator import DeepSpeedAccelerator  # noqa: F401
from .other_accelerators import not_built_accelerator

XPU_Accelerator = not_built_accelerator("XPU_Accelerator", "Intel XPU", __name__, "xpu", "xccl")
