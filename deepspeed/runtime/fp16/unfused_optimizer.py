# SPDX-License-Identifier: Apache-2.0
"""``FP16_UnfusedOptimizer``: the class of the optimizer a 16-bit engine without ZeRO returns when it steps an
optimizer other than ``FusedAdam`` (see :mod:`deepspeed.runtime.engine_parts.returned_optimizers`)."""

from deepspeed.runtime.engine_parts.returned_optimizers import FP16_UnfusedOptimizer  # noqa: F401

__all__ = ["FP16_UnfusedOptimizer"]
