# SPDX-License-Identifier: Apache-2.0
"""Upstream's Intel Gaudi (HPU) accelerator: not built (see ``other_accelerators.py``)."""

from .abstract_accelerator import DeepSpeedAccelerator  # noqa: F401
from .other_accelerators import not_built_accelerator

HPU_Accelerator = not_built_accelerator("HPU_Accelerator", "Intel Gaudi (HPU)", __name__, "hpu", "hccl")
