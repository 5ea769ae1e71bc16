# SPDX-License-Identifier: Apache-2.0
"""A snapshot of a checkpoint payload in host memory, so that training may go on while it is written.

:func:`stage_to_host` copies every tensor of a payload (dicts, lists, tuples and any other object that holds
tensors) into fresh host memory: one copy per storage, so tensors that shared a storage still share one and
``torch.save`` writes the same file as from the live payload. A view of a larger buffer is first given a storage of
its own bytes (``compaction``), so only what the file will hold is copied. Tensors on an accelerator go to
page-locked memory with asynchronous copies and one synchronisation at the end; host tensors are cloned. Non-tensor
values are deep-copied (a scheduler's state, a loss scaler), so that nothing the writer reads later can change
under it.
"""

import copy

import torch


class _Stager:

    def __init__(self):
        self.storages = {}  # (device, data_ptr, nbytes) of a source storage -> its host copy
        self.accelerated = False

    def storage(self, source):
        key = (str(source.device), source.data_ptr(), source.nbytes())
        copied = self.storages.get(key)
        if copied is None:
            if source.device.type == "cpu":
                copied = source.clone()
            else:
                self.accelerated = True
                host = torch.empty(source.nbytes(), dtype=torch.uint8, pin_memory=True)
                host.untyped_storage().copy_(source, non_blocking=True)
                copied = host.untyped_storage()
            self.storages[key] = copied
        return copied

    def tensor(self, tensor):
        storage = self.storage(tensor.untyped_storage())
        staged = torch.empty(0, dtype=tensor.dtype).set_(storage, tensor.storage_offset(), tensor.size(),
                                                         tensor.stride())
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(staged, requires_grad=tensor.requires_grad)
        return staged

    def value(self, obj, memo):
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj.detach()) if type(obj) in (torch.Tensor, torch.nn.Parameter) else \
                copy.deepcopy(obj, memo)
        if isinstance(obj, dict):
            out = copy.copy(obj)  # keeps the dict's type (OrderedDict) and attributes
            for key, value in obj.items():
                out[key] = self.value(value, memo)
            return out
        if type(obj) is list:
            return [self.value(v, memo) for v in obj]
        if type(obj) is tuple:
            return tuple(self.value(v, memo) for v in obj)
        if isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device, torch.Size)):
            return obj
        return copy.deepcopy(obj, memo)


def stage_to_host(payloads):
    """``payloads`` (a list of objects) copied into host memory (see the module docstring); returns the copies."""
    from deepspeed.runtime.checkpoint_engine.compaction import compact_views
    stager = _Stager()
    memo = {}
    # views of a larger buffer first get storages of their own bytes: only what the files hold is copied
    staged = [stager.value(payload, memo) for payload in compact_views(list(payloads))]
    if stager.accelerated:
        from deepspeed.accelerator import get_accelerator
        get_accelerator().synchronize()
    return staged


def staged_bytes(staged):
    """Bytes of tensor data a staged payload list holds (for statistics)."""
    seen = {}

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)

    walk(staged)
    return sum(seen.values())
