# SPDX-License-Identifier: Apache-2.0
"""Upstream's Cambricon MLU accelerator: not built (see ``other_accelerators.py``)."""

from .abstract_accelerator import DeepSpeedAccelerator  # noqa: F401
from .other_accelerators import not_built_accelerator

MLU_Accelerator = not_built_accelerator("MLU_Accelerator", "Cambricon MLU", __name__, "mlu", "cncl")
