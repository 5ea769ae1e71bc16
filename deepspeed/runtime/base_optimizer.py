# SPDX-License-Identifier: Apache-2.0
"""Marker base classes for the optimizers the engine returns.

Frameworks test ``isinstance(optimizer, DeepSpeedOptimizer)`` to recognise an
optimizer wrapped by DeepSpeed, and ``isinstance(optimizer, ZeROOptimizer)`` to
recognise one that partitions state (ZeRO stages 1-3). The classes hold no state
and define no behaviour.
"""


class DeepSpeedOptimizer(object):
    """Marks an optimizer wrapped by the DeepSpeed engine."""


class ZeROOptimizer(DeepSpeedOptimizer):
    """Marks a DeepSpeed optimizer that partitions optimizer state, gradients or parameters (ZeRO)."""
