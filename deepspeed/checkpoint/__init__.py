# SPDX-License-Identifier: Apache-2.0
"""Helpers for reading and writing checkpoint contents."""

from .utils import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]
