# SPDX-License-Identifier: Apache-2.0
"""Upstream's Biren SUPA accelerator: not built (see ``other_accelerators.py``)."""

from .abstract_accelerator import DeepSpeedAccelerator  # noqa: F401
from .other_accelerators import not_built_accelerator

SUPA_Accelerator = not_built_accelerator("SUPA_Accelerator", "Biren SUPA", __name__, "supa", "bccl")
