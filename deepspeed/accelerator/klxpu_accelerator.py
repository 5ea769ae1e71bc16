# SPDX-License-Identifier: Apache-2.0
"""Upstream's Kunlunxin XPU accelerator: not built (see ``other_accelerators.py``)."""

from .abstract_accelerator import DeepSpeedAccelerator  # noqa: F401
from .other_accelerators import not_built_accelerator

KLXPU_Accelerator = not_built_accelerator("KLXPU_Accelerator", "Kunlunxin XPU", __name__, "klxpu", "nccl")
