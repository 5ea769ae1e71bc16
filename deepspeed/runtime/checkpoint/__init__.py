# SPDX-License-Identifier: Apache-2.0
"""Checkpoints of ZeRO stages 0-3: saving, loading across stages and world sizes (see docs/checkpoints.md)."""

# The engine's mixin (``engine_mixin``) is imported from its module, not from here: it reaches upstream's
# ``deepspeed.checkpoint`` package, which reads this package's modules, so re-exporting it would close a circle.
from deepspeed.runtime.checkpoint.validate import CheckpointError  # noqa: F401

__all__ = ["CheckpointError"]
