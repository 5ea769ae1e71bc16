# SPDX-License-Identifier: Apache-2.0
"""Upstream's Tecorigin SDAA accelerator: not built (see ``other_accelerators.py``)."""

from .abstract_accelerator import DeepSpeedAccelerator  # noqa: F401
from .other_accelerators import not_built_accelerator

SDAA_Accelerator = not_built_accelerator("SDAA_Accelerator", "Tecorigin SDAA", __name__, "sdaa", "tccl")
