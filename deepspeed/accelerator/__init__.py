# SPDX-License-Identifier: Apache-2.0
"""Device abstraction: ``get_accelerator()`` answers every device question (CUDA or CPU)."""

from .abstract_accelerator import DeepSpeedAccelerator
from .real_accelerator import get_accelerator, is_current_accelerator_supported, set_accelerator

__all__ = ["DeepSpeedAccelerator", "get_accelerator", "set_accelerator", "is_current_accelerator_supported"]
