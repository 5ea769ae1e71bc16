# SPDX-License-Identifier: Apache-2.0
"""Preparing tensors for ``torch.save``.

``torch.save`` writes a tensor's whole storage, so saving a small view of a large
flat buffer (a ZeRO partition, a bucket) writes the whole buffer. Cloning first
gives each tensor a storage of its own size.
"""

import copy

import torch


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
