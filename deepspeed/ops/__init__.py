# SPDX-License-Identifier: Apache-2.0
"""Optimizer ops: Adam variants built on torch's fused/foreach kernels (``adam``) and ``lamb``."""

from deepspeed.ops import adam, lamb  # noqa: F401
