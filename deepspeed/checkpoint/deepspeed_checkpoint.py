# SPDX-License-Identifier: Apache-2.0
"""``DeepSpeedCheckpoint``: a read-only view of one checkpoint tag folder, upstream's class name and accessors.

Upstream's class describes Megatron-style checkpoints (tensor x pipeline x data parallel degrees, layer
files) and reshapes them. What it offers here: the folder's files (``file_list``, ``mp_rank_files``,
``zero_files``, ``layer_files``), the degrees (``tp_degree``, ``pp_degree``, ``dp_degree`` and their
``original_*``, ``world_size``; a pipeline checkpoint's from its ``checkpoint_parallel_dimensions`` or its
files), the model-states entries (``global_state``, :meth:`get_iteration`, :meth:`get_args`,
:meth:`get_checkpoint_info`) and each rank's ZeRO optimizer file (:meth:`get_zero_checkpoint_state`,
:meth:`get_zero_files`, by pipeline stage and data-parallel rank). A request for another tensor or pipeline
degree raises NotImplementedError (the Megatron-specific merging of layers is not built; ``ZeROCheckpoint``
maps the files, and a ``PipelineEngine`` loads a pipeline checkpoint into any cut by parameter name).
"""

import glob
import os
import re

from deepspeed.checkpoint import constants as C
from deepspeed.runtime.checkpoint.reader import load_file

ARGS_KEY = "args"
CHECKPOINT_INFO_KEY = "checkpoint_info"
ITERATION_KEY = "iteration"


def _natural(text):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _rank_of(path):
    match = re.search(r"zero_pp_rank_(\d+)_", os.path.basename(path))
    return int(match.group(1)) if match else -1


def _mp_rank_of(path):
    match = re.search(r"_mp_rank_(\d+)_", os.path.basename(path))
    return int(match.group(1)) if match else 0


class DeepSpeedCheckpoint:
    """The checkpoint tag folder ``dir`` (written by this package or by upstream DeepSpeed)."""

    def __init__(self, dir, tp_degree=None, pp_degree=None, dp_degree=None, final_layer_norm_idx=-1):
        if not os.path.isdir(dir):
            raise FileNotFoundError(f"{dir}: not a checkpoint folder")
        self.dir = dir
        self.final_layer_norm_idx = final_layer_norm_idx
        self.file_list = sorted(glob.glob(os.path.join(dir, "*")), key=_natural)
        self.layer_files = [f for f in self.file_list if os.path.basename(f).startswith(C.LAYER_FILE_PREFIX)]
        self.mp_rank_files = [f for f in self.file_list if os.path.basename(f).startswith(C.MODEL_FILE_PREFIX)]
        self.zero_files = sorted([f for f in self.file_list if f.endswith(C.OPTIM_FILE_SUFFIX)], key=_rank_of)
        zero3_models = [
            f for f in self.file_list
            if os.path.basename(f).startswith(C.ZERO_FILE_PREFIX) and f.endswith(C.MODEL_FILE_SUFFIX)
        ]
        model_file = (self.mp_rank_files or sorted(zero3_models, key=_rank_of) or [None])[0]
        if model_file is None:
            raise FileNotFoundError(f"{dir}: no model-states file ({C.MODEL_FILE_PREFIX}*{C.MODEL_FILE_SUFFIX} or "
                                    f"{C.ZERO_FILE_PREFIX}*{C.MODEL_FILE_SUFFIX})")
        self.model_file = model_file
        self.global_state = {}
        self._model_states = None
        states = self._states()
        for key in (ARGS_KEY, CHECKPOINT_INFO_KEY, C.UNIVERSAL_CHECKPOINT_INFO):
            if key in states:
                self.global_state[key] = states[key]
        self.global_state[ITERATION_KEY] = states.get(ITERATION_KEY, states.get("global_steps", 0))
        dims = states.get(C.CHECKPOINT_PARALLEL_DIMS)
        if isinstance(dims, dict):
            self.original_tp_degree = int(dims.get(C.CHECKPOINT_TP_DEGREE) or 1)
            self.original_pp_degree = int(dims.get(C.CHECKPOINT_PP_DEGREE) or 1)
        elif self.layer_files:  # a pipeline checkpoint: one model-states file per stage (and tensor rank)
            self.original_tp_degree = 1
            self.original_pp_degree = max(1, len(self.mp_rank_files))
        else:
            self.original_tp_degree = int(states.get("mp_world_size") or 1)
            self.original_pp_degree = 1
        self.original_dp_degree = int(states.get("dp_world_size") or max(1, len(self.zero_files)))
        self.tp_degree = self.original_tp_degree if tp_degree is None else tp_degree
        self.pp_degree = self.original_pp_degree if pp_degree is None else pp_degree
        self.dp_degree = self.original_dp_degree if dp_degree is None else dp_degree
        if self.is_change_tp_degree() or self.is_change_pp_degree():
            raise NotImplementedError(f"{dir}: reshaping to tp_degree={self.tp_degree}, pp_degree={self.pp_degree} "
                                      f"is not supported (data-parallel checkpoints reshard at load_checkpoint)")
        self.original_world_size = self.original_tp_degree * self.original_pp_degree * self.original_dp_degree
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree

    def _states(self):
        if self._model_states is None:
            self._model_states = load_file(self.model_file, "the model states")
        return self._model_states

    def is_change_tp_degree(self):
        return self.tp_degree != self.original_tp_degree

    def is_change_pp_degree(self):
        return self.pp_degree != self.original_pp_degree

    def is_change_dp_degree(self):
        return self.dp_degree != self.original_dp_degree

    def get_iteration(self):
        return self.global_state[ITERATION_KEY]

    def _get_checkpoint_value(self, key):
        if key not in self.global_state:
            self.global_state[key] = self._states().get(key)
        return self.global_state[key]

    def get_args(self):
        return self._get_checkpoint_value(ARGS_KEY)

    def get_checkpoint_info(self, info_key=CHECKPOINT_INFO_KEY):
        return self._get_checkpoint_value(info_key)

    def get_zero_files(self, pp_index, tp_index, dp_index):
        """The optimizer file of data-parallel rank ``dp_index`` of stage ``pp_index`` (a list, as upstream)."""
        self._check_index(pp_index, tp_index, dp_index)
        mp_rank = pp_index * self.original_tp_degree + tp_index
        return [f for f in self.zero_files if _rank_of(f) == dp_index and _mp_rank_of(f) == mp_rank]

    def get_zero_checkpoint_state(self, pp_index, tp_index, dp_index, strip_tensor_paddings=True):
        """The loaded optimizer file of data-parallel rank ``dp_index`` (its ``param_shapes`` entry left out)."""
        files = self.get_zero_files(pp_index, tp_index, dp_index)
        if not files:
            raise FileNotFoundError(f"{self.dir}: no optimizer file of data-parallel rank {dp_index}")
        state = load_file(files[0], f"the optimizer partition of rank {dp_index}")
        state.pop(C.PARAM_SHAPES, None)
        return state

    def _check_index(self, pp_index, tp_index, dp_index):
        if not (0 <= pp_index < self.original_pp_degree and 0 <= tp_index < self.original_tp_degree):
            raise IndexError(f"{self.dir}: (pp_index {pp_index}, tp_index {tp_index}) outside the saved "
                             f"{self.original_pp_degree} x {self.original_tp_degree} stages x tensor ranks")
        if not 0 <= dp_index < self.original_dp_degree:
            raise IndexError(f"{self.dir}: dp_index {dp_index} outside the {self.original_dp_degree} saved ranks")

    def show_2d_mapping(self):
        print(f"reshape 2D map: tp {self.original_tp_degree} -> {self.tp_degree}, pp {self.original_pp_degree} -> "
              f"{self.pp_degree}")
