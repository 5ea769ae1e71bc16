# SPDX-License-Identifier: Apache-2.0
"""``BF16_Optimizer``: the class of the optimizer ZeRO stage 1 returns for a bf16 model with fp32 gradient
accumulation (see :mod:`deepspeed.runtime.engine_parts.returned_optimizers`)."""

from deepspeed.runtime.engine_parts.returned_optimizers import BF16_Optimizer  # noqa: F401

__all__ = ["BF16_Optimizer"]
