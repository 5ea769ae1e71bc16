# SPDX-License-Identifier: Apache-2.0
"""Helpers of the checkpoint reshaping tools: the files of a folder, their order, and merging states.

``merge_state(a, b)`` joins two ranks' states of the same structure: tensors are concatenated along dim 0,
dicts merged key by key (a key only one of them has is kept, ``a``'s keys first), lists and tuples element by
element; anything else is taken from ``a``. A mismatch raises ``ValueError`` and prints the key path.
"""

import os
import re
from collections import OrderedDict

import torch

from deepspeed.checkpoint.constants import (BF16_ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, MODEL_FILE_PREFIX,
                                            ZERO_FILE_PREFIX)


def basic_folder_validation(dir):
    if not os.path.exists(dir):
        raise AssertionError(f"{dir} path does not exist")
    if not os.path.isdir(dir):
        raise AssertionError(f"{dir} is not a folder")


def get_files_with_prefix(all_files, prefix):
    """The paths among ``all_files`` whose file name starts with ``prefix``, sorted."""
    return sorted(path for path in all_files if os.path.basename(path).startswith(prefix))


def validate_files(file_list):
    for path in file_list:
        if not os.path.isfile(path):
            print(f"Error: {path} is not existent")


def get_files(dir):
    """Every file under ``dir`` (recursively)."""
    return [os.path.join(root, name) for root, _, names in os.walk(dir) for name in names]


def sort_zero_files(files, prefix):
    """ZeRO files ordered by (data-parallel rank, model-parallel rank)."""
    pattern = re.compile(f"{re.escape(prefix)}([0-9]+)_{MODEL_FILE_PREFIX}([0-9]+)")
    ranked = []
    for path in files:
        match = pattern.search(path)
        if match is None:
            raise ValueError(f"Cannot parse dp_rank and mp_rank from {path}")
        ranked.append((int(match.group(1)), int(match.group(2)), path))
    return [path for _, _, path in sorted(ranked)]


def get_zero_files(dir):
    """The folder's ZeRO optimizer files (plain, fp16_ or bf16_ prefixed, the first kind found), in rank order."""
    files = get_files(dir)
    for prefix in (ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX):
        found = get_files_with_prefix(files, prefix)
        if found:
            return sort_zero_files(found, prefix)
    return []


def partition_data(data_list, num_partitions):
    """``data_list`` cut into ``num_partitions`` consecutive equal parts."""
    if len(data_list) % num_partitions != 0:
        raise AssertionError(f"{len(data_list)} items cannot be cut into {num_partitions} equal parts")
    size = len(data_list) // num_partitions
    return [data_list[i:i + size] for i in range(0, len(data_list), size)]


def _key_list_to_string(key_list):
    return ".".join(key_list)


def merge_state_dict(dict_a, dict_b, key_list):
    merged = type(dict_a)()
    for key, value in dict_a.items():
        merged[key] = merge_state(value, dict_b[key], key_list + [str(key)]) if key in dict_b else value
    for key, value in dict_b.items():
        if key not in dict_a:
            merged[key] = value
    return merged


def merge_state_list(list_a, list_b, key_list):
    if len(list_a) != len(list_b):
        print(f"{_key_list_to_string(key_list)}")
        raise ValueError(f"Cannot merge lists of different lengths, a = {len(list_a)} b = {len(list_b)}")
    return [merge_state(a, b, key_list) for a, b in zip(list_a, list_b)]


def merge_state(state_a, state_b, key_list=()):
    """Merge two ranks' states (module docstring)."""
    key_list = list(key_list)
    if type(state_a) is not type(state_b):
        print(f"key_list = {_key_list_to_string(key_list)}")
        raise ValueError(f"Cannot merge two states of types {type(state_a)} and type {type(state_b)}")
    if isinstance(state_a, (dict, OrderedDict)):
        return merge_state_dict(state_a, state_b, key_list)
    if isinstance(state_a, (list, tuple)):
        return type(state_a)(merge_state_list(state_a, state_b, key_list))
    if torch.is_tensor(state_a):
        if state_a.dim() == 0:  # a scalar (an optimizer's step) is the same on every rank
            return state_a
        return torch.cat([state_a, state_b], 0)
    return state_a
