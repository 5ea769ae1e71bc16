# SPDX-License-Identifier: Apache-2.0
"""Checkpoint formats: upstream DeepSpeed's (read and written), the universal one, and helpers.

* :mod:`.constants`: upstream's key and file names;
* :mod:`.upstream_format` / :mod:`.upstream_writer`: upstream's ZeRO checkpoints, read into and
  written from the stage-independent full state;
* :mod:`.universal_checkpoint`, :mod:`.ds_to_universal`: the universal format;
* :class:`DeepSpeedCheckpoint`, the file-name helpers of :mod:`.utils`.
"""

from .constants import *  # noqa: F401,F403
from .deepspeed_checkpoint import DeepSpeedCheckpoint
from .utils import (clone_tensors_for_torch_save, get_layer_ckpt_name_for_rank, get_model_ckpt_name_for_rank,
                    get_zero_ckpt_name_for_rank)

__all__ = [
    "clone_tensors_for_torch_save", "DeepSpeedCheckpoint", "get_layer_ckpt_name_for_rank",
    "get_model_ckpt_name_for_rank", "get_zero_ckpt_name_for_rank"
]
