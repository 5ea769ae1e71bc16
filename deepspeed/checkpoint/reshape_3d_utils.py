# SPDX-License-Identifier: Apache-2.0
"""The (pipeline, tensor, data) degrees of a checkpoint, and which saved ranks each rank of a smaller run reads.

:class:`model_3d_desc` holds the three degrees. ``reshape(target)`` contracts the pipeline and tensor axes as
``reshape_meg_2d_parallel`` does, repeats each saved 2D rank for every data-parallel replica (saved rank
``r + i * pp * tp`` is replica ``i``'s copy of 2D rank ``r``), then cuts the list of each target position into
``target.dp_degree`` consecutive parts: one :class:`meg_2d_parallel_map` per target data-parallel rank.

:func:`get_model_3d_descriptor` reads a checkpoint folder's degrees: from the ``checkpoint_parallel_dimensions``
of its model-states files when they have it (all of them, the same), else from its files (the number of model
files per layer for the tensor degree, the rest for the pipeline), the data-parallel degree from the ZeRO files.
"""

import torch

from deepspeed.checkpoint.constants import (CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE,
                                            LAYER_FILE_PREFIX, MODEL_FILE_PREFIX)
from deepspeed.checkpoint.reshape_meg_2d import meg_2d_parallel_map, reshape_meg_2d_parallel
from deepspeed.checkpoint.reshape_utils import get_files, get_files_with_prefix, get_zero_files, partition_data

PP_DIM = "PP"
TP_DIM = "TP"
DP_DIM = "DP"


class model_3d_desc:
    """Pipeline, tensor and data-parallel degrees of a checkpoint or a run."""

    def __init__(self, pp_degree=1, tp_degree=1, dp_degree=1):
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.dp_degree = dp_degree

    def reshape(self, target_3d_desc, verbose=False):
        """Per target data-parallel rank, the map of saved ranks each target position reads (module docstring)."""
        valid, errors = self.can_reshape(target_3d_desc)
        if not valid:
            raise AssertionError(",".join(errors))
        tgt_2d = reshape_meg_2d_parallel(old_pp_degree=self.pp_degree,
                                         old_tp_degree=self.tp_degree,
                                         new_pp_degree=target_3d_desc.pp_degree,
                                         new_tp_degree=target_3d_desc.tp_degree,
                                         verbose=verbose)
        flat = flatten_dp_dimension(tgt_2d, self.pp_degree * self.tp_degree, self.dp_degree)
        return unflatten_dp_dimension(flat, target_3d_desc.dp_degree)

    def get_desc(self):
        return f"{PP_DIM},{TP_DIM},{DP_DIM} = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"

    def world_size(self):
        return self.pp_degree * self.tp_degree * self.dp_degree

    def is_valid(self, pp_index, tp_index, dp_index):
        errors = [
            f"{name} indexing error: index {index} >= degree {degree}"
            for index, degree, name in [(pp_index, self.pp_degree, PP_DIM), (tp_index, self.tp_degree,
                                                                             TP_DIM), (dp_index, self.dp_degree,
                                                                                       DP_DIM)] if index >= degree
        ]
        return not errors, errors

    def can_reshape(self, target_3d_desc):
        """``(ok, errors)``: only contraction of each degree is supported."""
        errors = [
            f"Expansion reshape not supported - {name}: {mine} ---> {theirs}" for name, mine, theirs in [(
                PP_DIM, self.pp_degree, target_3d_desc.pp_degree), (
                    TP_DIM, self.tp_degree,
                    target_3d_desc.tp_degree), (DP_DIM, self.dp_degree, target_3d_desc.dp_degree)] if theirs > mine
        ]
        return not errors, errors


def get_model_3d_descriptor_from_metadata(file_list, zero_file_list, model_state_metadata):
    """The degrees from ``[(model file, {checkpoint_parallel_dimensions: ...})]`` and the folder's file lists."""
    model_files = [path for path, _ in model_state_metadata]
    found, missing = [], []
    for path, metadata in model_state_metadata:
        dims = metadata.get(CHECKPOINT_PARALLEL_DIMS)
        if dims is None:
            missing.append(path)
            continue
        if not isinstance(dims, dict):
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} must be a dictionary in {path}.")
        values = []
        for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE):
            value = dims.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RuntimeError(f"Checkpoint {key} must be a positive integer in {path}, got {value!r}.")
            values.append(value)
        found.append(tuple(values))
    if found:
        if missing:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} is missing from model-state files: {missing}")
        if len(set(found)) != 1:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: {found}")
        pp, tp = found[0]
        if len(model_files) != pp * tp:
            raise RuntimeError(f"Checkpoint model-state file count {len(model_files)} does not match "
                               f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")
        if len(zero_file_list) % (pp * tp) != 0:
            raise RuntimeError(f"Checkpoint ZeRO file count {len(zero_file_list)} is not divisible by "
                               f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")
        return model_3d_desc(pp, tp, max(1, len(zero_file_list) // (pp * tp)))
    per_layer = len(get_files_with_prefix(file_list, f"{LAYER_FILE_PREFIX}01"))
    if per_layer > 0:
        tp = per_layer
        pp = len(model_files) // tp
    else:
        tp, pp = len(model_files), 1
    return model_3d_desc(pp, tp, max(1, len(zero_file_list) // (pp * tp)))


def get_model_3d_descriptor(dir):
    """The degrees of the checkpoint folder ``dir`` (module docstring)."""
    files = get_files(dir)
    zero_files = get_zero_files(dir)
    metadata = []
    for path in get_files_with_prefix(files, MODEL_FILE_PREFIX):
        states = torch.load(path, map_location="cpu", weights_only=False)
        metadata.append((path, {CHECKPOINT_PARALLEL_DIMS: states.get(CHECKPOINT_PARALLEL_DIMS)}))
        del states
    return get_model_3d_descriptor_from_metadata(files, zero_files, metadata)


def flatten_dp_dimension(meg_2d_map, src_2d_size, dp_degree):
    """Each position's saved 2D ranks, followed by every data-parallel replica's copy of them."""
    out = meg_2d_parallel_map(meg_2d_map.pp_degree, meg_2d_map.tp_degree)
    for i in range(meg_2d_map.pp_degree):
        for j in range(meg_2d_map.tp_degree):
            for rank in meg_2d_map.get_data(i, j):
                out.add_data(i, j, [rank + replica * src_2d_size for replica in range(dp_degree)])
    return out


def unflatten_dp_dimension(meg_2d_map, dp_degree):
    """One map per target data-parallel rank: each position's list cut into ``dp_degree`` consecutive parts."""
    maps = [meg_2d_parallel_map(meg_2d_map.pp_degree, meg_2d_map.tp_degree) for _ in range(dp_degree)]
    for i in range(meg_2d_map.pp_degree):
        for j in range(meg_2d_map.tp_degree):
            for ranks, target in zip(partition_data(meg_2d_map.get_data(i, j), dp_degree), maps):
                target.add_data(i, j, ranks)
    return maps
