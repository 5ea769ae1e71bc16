# SPDX-License-Identifier: Apache-2.0
"""Checkpoint formats: upstream DeepSpeed's (read and written), the universal one, and helpers.

* :mod:`.constants`: upstream's key and file names;
* :mod:`.upstream_format` / :mod:`.upstream_writer`: upstream's ZeRO checkpoints, read into and
  written from the stage-independent full state;
* :mod:`.universal_checkpoint`, :mod:`.ds_to_universal`: the universal format;
* :class:`DeepSpeedCheckpoint`, the file-name helpers of :mod:`.utils`;
* the reshaping tools: :class:`model_3d_desc` / :func:`get_model_3d_descriptor` (:mod:`.reshape_3d_utils`),
  :func:`reshape_meg_2d_parallel`, :func:`merge_state` and :class:`ZeROCheckpoint` (which saved ZeRO files each
  rank of a run with smaller pipeline, tensor and data degrees takes over).
"""

from .constants import *  # noqa: F401,F403
from .deepspeed_checkpoint import DeepSpeedCheckpoint
from .reshape_3d_utils import get_model_3d_descriptor, model_3d_desc
from .reshape_meg_2d import reshape_meg_2d_parallel
from .reshape_utils import merge_state
from .utils import (clone_tensors_for_torch_save, get_layer_ckpt_name_for_rank, get_model_ckpt_name_for_rank,
                    get_zero_ckpt_name_for_rank)
from .zero_checkpoint import ZeROCheckpoint

__all__ = [
    "clone_tensors_for_torch_save", "DeepSpeedCheckpoint", "get_layer_ckpt_name_for_rank",
    "get_model_ckpt_name_for_rank", "get_zero_ckpt_name_for_rank", "get_model_3d_descriptor", "merge_state",
    "model_3d_desc", "reshape_meg_2d_parallel", "ZeROCheckpoint"
]
