# SPDX-License-Identifier: Apache-2.0
"""Checkpoints of ZeRO stages 0-3: saving, loading across stages and world sizes (see docs/checkpoints.md)."""

from deepspeed.runtime.checkpoint.engine_mixin import CheckpointEngineMixin, attach  # noqa: F401
from deepspeed.runtime.checkpoint.validate import CheckpointError  # noqa: F401

__all__ = ["CheckpointEngineMixin", "attach", "CheckpointError"]
