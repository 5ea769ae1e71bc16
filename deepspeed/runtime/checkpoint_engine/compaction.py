# SPDX-License-Identifier: Apache-2.0
"""Views of a larger buffer cut to their own bytes before ``torch.save``, without copying.

``torch.save`` writes the whole storage of every tensor it meets, once per storage. A parameter that is a view
of a flat buffer (ZeRO's bucketed parameters, a partition of a flat master, a slice of a gradient buffer) would
drag the whole buffer into the file, once for all the views of it that the payload holds. :func:`compact_views`
gives such views storages of their own that alias exactly the bytes they span (``UntypedStorage`` slicing shares
memory): the file then holds what the tensors hold, and nothing is copied. Host tensors only: a tensor on an
accelerator is written as ``torch.save`` writes it (its storage copied to the host).

Per source storage the payload's distinct views are counted: when their spans add up to less than the storage,
each view gets its own aliasing storage (views that are the same, a tied weight under two names, get the same
one, so it is written once and loads tied); otherwise the storage is written as it is (it is no bigger than the
views' bytes, and tensors that shared it still do after a load).
"""

import copy

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _eligible(tensor):
    """A plain dense host tensor whose values are its storage's bytes read through its strides (a lazily conjugated
    or negated view, a named, nested or quantized tensor carries more, and is written as it is). Tensors on an
    accelerator are left as they are: ``torch.save`` copies their storages to the host as before (the module entry
    already holds host copies of each view, ``model_state.host_tensors``)."""
    return (type(tensor) in _PLAIN and tensor.layout == torch.strided and tensor.device.type == "cpu"
            and not tensor.is_quantized and not tensor.is_nested and not tensor.is_conj() and not tensor.is_neg()
            and not any(getattr(tensor, "names", None) or ()))


def _span(tensor):
    """``(first element, elements)`` of the storage that ``tensor`` reads (its offset and extent)."""
    if tensor.numel() == 0:
        return tensor.storage_offset(), 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()) if size > 1)
    return tensor.storage_offset(), extent


def _view_key(tensor):
    return (tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))


def _storage_key(tensor):
    storage = tensor.untyped_storage()
    return (str(tensor.device), storage.data_ptr(), storage.nbytes())


def _walk(obj, visit, seen):
    if isinstance(obj, torch.Tensor):
        visit(obj)
    elif isinstance(obj, (dict, list, tuple)) and id(obj) not in seen:
        seen.add(id(obj))
        for value in (obj.values() if isinstance(obj, dict) else obj):
            _walk(value, visit, seen)


class _Compactor:

    def __init__(self):
        self.views = {}  # storage key -> {view key: span bytes}
        self.aliases = {}  # (storage key, view key) -> the aliasing tensor
        self.cut = set()  # storage keys whose views get storages of their own
        self.memo = {}  # id(container) -> its rebuilt copy (a container met twice stays one object)

    def count(self, tensor):
        if not _eligible(tensor):
            return
        extent = _span(tensor)[1]
        self.views.setdefault(_storage_key(tensor), {})[_view_key(tensor)] = extent * tensor.element_size()

    def decide(self):
        for key, views in self.views.items():
            if sum(views.values()) < key[2]:
                self.cut.add(key)

    def tensor(self, tensor):
        if not _eligible(tensor):
            return tensor
        key = _storage_key(tensor)
        if key not in self.cut:
            return tensor
        view = _view_key(tensor)
        alias = self.aliases.get((key, view))
        if alias is None:
            start, extent = _span(tensor)
            size = tensor.element_size()
            storage = tensor.untyped_storage()[start * size:(start + extent) * size]
            alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(storage, 0, tensor.shape,
                                                                                  tensor.stride())
            self.aliases[(key, view)] = alias
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(alias, requires_grad=tensor.requires_grad)
        return alias

    def value(self, obj):
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if not isinstance(obj, (dict, list, tuple)):
            return obj
        if id(obj) in self.memo:
            return self.memo[id(obj)]
        if isinstance(obj, dict):
            items = {key: self.value(value) for key, value in obj.items()}
            if all(items[key] is value for key, value in obj.items()):
                out = obj
            else:
                out = copy.copy(obj)  # keeps the mapping's type and attributes (an OrderedDict's order)
                out.update(items)
        else:
            values = [self.value(value) for value in obj]
            if all(new is old for new, old in zip(values, obj)):
                out = obj
            elif isinstance(obj, list):
                out = copy.copy(obj)  # keeps a list subclass's type and attributes
                out[:] = values
            elif hasattr(obj, "_fields"):
                out = type(obj)(*values)
            else:
                out = type(obj)(values)
        self.memo[id(obj)] = out
        return out


def compact_views(obj):
    """``obj`` (dicts, lists, tuples holding tensors) with every view of a larger storage given a storage of its own
    bytes, aliasing the same memory (see the module docstring). Values, dtypes, shapes, strides and devices are
    unchanged and nothing is copied; containers without such a view are returned as they are, the others as
    shallow copies of the same type. The aliases read the live memory: the payload is to be written before it
    changes, as ``torch.save`` of the original would be."""
    compactor = _Compactor()
    _walk(obj, compactor.count, set())
    compactor.decide()
    if not compactor.cut:
        return obj
    return compactor.value(obj)
