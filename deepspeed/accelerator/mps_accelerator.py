# SPDX-License-Identifier: Apache-2.0
"""Upstream's Apple MPS accelerator: not built (see ``other_accelerators.py``)."""

from .abstract_accelerator import DeepSpeedAccelerator  # noqa: F401
from .other_accelerators import not_built_accelerator

MPS_Accelerator = not_built_accelerator("MPS_Accelerator", "Apple MPS", __name__, "mps", "gloo")
