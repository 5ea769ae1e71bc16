# SPDX-License-Identifier: Apache-2.0
"""Checkpoint file names of a rank, and preparing tensors for ``torch.save``.

``torch.save`` writes a tensor's whole storage, so saving a small view of a large
flat buffer (a ZeRO partition, a bucket) writes the whole buffer. Cloning first
gives each tensor a storage of its own size.
"""

import copy
import os

import torch

from deepspeed.checkpoint.constants import (MODEL_FILE_PREFIX, MODEL_FILE_SUFFIX, OPTIM_FILE_SUFFIX, ZERO_FILE_PREFIX)


def get_model_ckpt_name_for_rank(base_folder, mp_rank_str):
    """``<base_folder>/mp_rank_<mp_rank_str>_model_states.pt`` (``mp_rank_str``: e.g. ``"00"``)."""
    return os.path.join(base_folder, f"{MODEL_FILE_PREFIX}{mp_rank_str}{MODEL_FILE_SUFFIX}")


def get_zero_ckpt_name_for_rank(base_folder, dp_rank, mp_rank):
    """``<base_folder>/zero_pp_rank_<dp_rank>_mp_rank_<mp_rank:02d>_optim_states.pt``."""
    return os.path.join(base_folder,
                        f"{ZERO_FILE_PREFIX}{dp_rank}_{MODEL_FILE_PREFIX}{mp_rank:02d}{OPTIM_FILE_SUFFIX}")


def get_layer_ckpt_name_for_rank(base_folder, layer_id, tp_rank):
    """``<base_folder>/<layer_id>-model_<tp_rank:02d>_model_states.pt`` (``layer_id`` such as ``"layer_01"``)."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}{MODEL_FILE_SUFFIX}")


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """A copy of ``item`` in which every tensor is a detached, compact copy on ``device``.

    Dicts (keeping their type, e.g. ``OrderedDict``), lists, tuples and named
    tuples are walked recursively; other objects are returned as they are. The
    copies never share storage with the originals, even when already on ``device``.
    """
    if torch.is_tensor(item):
        return item.detach().to(device, copy=True)
    if isinstance(item, dict):
        cloned = {key: clone_tensors_for_torch_save(value, device) for key, value in item.items()}
        if type(item) is dict:
            return cloned
        # A shallow copy keeps the mapping's type and extra state (an OrderedDict's order, a defaultdict's factory).
        mapping = copy.copy(item)
        mapping.update(cloned)
        return mapping
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(value, device) for value in item]
    if isinstance(item, tuple):
        values = [clone_tensors_for_torch_save(value, device) for value in item]
        return type(item)(*values) if hasattr(item, "_fields") else type(item)(values)
    return item
