# SPDX-License-Identifier: Apache-2.0
"""Where an engine's state tensors live, and moving them off the device and back (``engine.offload_states``).

The stage gives a *state table*: for each ``OffloadStateTypeEnum`` kind, the tensors of that kind it
holds on its device (16-bit parameters, fp32 masters, optimizer state, window gradient, reduction staging).
:class:`StatePlacement` turns the table into storages (several tensors, views of one flat buffer, share
one) and moves whole storages:

* **offload**: each chosen storage's bytes are copied into one host buffer (pinned with ``pin_memory``),
  every tensor of the table that uses it is pointed at the matching host view (``tensor.data``: what the
  user, an optimizer or the model can reach reads host memory, never freed memory), and the device
  storage is resized to zero bytes, which frees it while every other view of it (layout views, gradient
  views the pipeline keeps) stays the same object;
* **reload**: each storage gets its bytes back in place (``resize_`` then one copy), and the table's
  tensors are pointed at their device views again. Same bytes, same storages, same views: training
  continues bit-identical to a run that never offloaded.

A storage serves every kind whose tensors use it (ZeRO-0 fp32 parameters are their own masters): it
moves when any of its kinds is included, and then all of its kinds count as offloaded. Offloading an
offloaded storage again, or reloading when nothing is offloaded, does nothing.

All copies run on the current stream; with ``non_blocking`` the host does not wait for them (a reload or a
kernel on the same stream is ordered after them; read the host views only after a synchronize). The host
buffer is kept for the next offload it fits (RL loops offload every step; pinning is slow).
"""

import torch

from deepspeed.accelerator import get_accelerator

ALIGN = 64  # bytes: every storage starts its host slice at a multiple (any dtype's views line up)


class _Entry:
    """One device storage of the table: the kinds it serves, the table's tensors that use it."""

    __slots__ = ("storage", "nbytes", "kinds", "tensors", "offset", "device_views")

    def __init__(self, storage):
        self.storage = storage
        self.nbytes = storage.nbytes()
        self.kinds = set()
        self.tensors = []
        self.offset = 0
        self.device_views = []


def _bytes_view(storage, device):
    """A uint8 tensor over every byte of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _typed_view(like, storage, byte_offset):
    """A tensor over ``storage`` with ``like``'s dtype, shape and strides, ``like``'s storage offset moved by
    ``byte_offset`` bytes."""
    itemsize = like.element_size()
    offset = byte_offset // itemsize + like.storage_offset()
    return torch.empty(0, dtype=like.dtype, device=storage.device).set_(storage, offset, like.size(), like.stride())


def _pinned_bytes(numel):
    """``numel`` page-locked bytes: exactly that many (an anonymous mapping, locked and registered with the
    device runtime: ``deepspeed.utils.pin_memory``) where the locked-memory limit allows, else torch's pinned
    allocator (which rounds up to a power of two)."""
    from deepspeed.utils.pin_memory import get_native_pinned_memory
    try:
        return get_native_pinned_memory().pin_empty(torch.empty(0, dtype=torch.uint8), (numel, ))
    except (OSError, RuntimeError, ValueError):
        return torch.empty(numel, dtype=torch.uint8, pin_memory=True)


class StatePlacement:
    """The moves of one engine's state table (see the module docstring)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._moved = {}  # storage key at offload time -> _Entry
        self._host = None  # the host buffer of the moved storages (uint8)
        self._pinned = False

    # ----------------------------------------------------------------- queries
    def offloaded_kinds(self):
        """The kinds with at least one storage on the host now."""
        kinds = set()
        for entry in self._moved.values():
            kinds |= entry.kinds
        return kinds

    @property
    def offloaded(self):
        return bool(self._moved)

    def host_bytes(self):
        return sum(entry.nbytes for entry in self._moved.values())

    def entries(self, table):
        """The table's device storages: ``{key: _Entry}`` (zero-byte storages and other devices left out)."""
        entries = {}
        seen = set()
        host = self._host.untyped_storage().data_ptr() if self._host is not None and self._moved else None
        for kind, tensors in table.items():
            for tensor in tensors:
                if tensor is None or tensor.device != self.device:
                    continue
                storage = tensor.untyped_storage()
                if storage.nbytes() == 0:
                    continue
                key = storage.data_ptr()
                if key == host:  # offloaded already: a view of the host copy (a CPU engine's "device" too)
                    continue
                entry = entries.get(key)
                if entry is None:
                    entry = entries[key] = _Entry(storage)
                entry.kinds.add(kind)
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    entry.tensors.append(tensor)
        return entries

    @staticmethod
    def devices(table, kind):
        """The devices the tensors of ``kind`` live on now (an offloaded tensor is a host view)."""
        return {tensor.device for tensor in table.get(kind, ()) if tensor is not None and tensor.numel()}

    # ------------------------------------------------------------------- moves
    def offload(self, table, include, pin_memory=True, non_blocking=False):
        """Move every device storage of ``table`` serving a kind in ``include`` to the host; returns the bytes
        moved."""
        include = set(include)
        chosen = [e for e in self.entries(table).values() if e.kinds & include]
        if not chosen:
            return 0
        start = self._host.numel() if self._moved else 0  # storages on the host already keep their bytes
        total = start
        for entry in chosen:
            entry.offset = total
            total += (entry.nbytes + ALIGN - 1) // ALIGN * ALIGN
        base = self._host_buffer(total, pin_memory)
        host_storage = base.untyped_storage()
        # Every copy is issued asynchronously (into pinned memory they overlap nothing but each other, at the
        # link's bandwidth); the host waits once, unless ``non_blocking``. Freeing a device storage right after
        # its copy is issued is safe: the allocator hands its memory out again only to work ordered after it.
        for entry in chosen:
            host = base.narrow(0, entry.offset, entry.nbytes)
            host.copy_(_bytes_view(entry.storage, self.device), non_blocking=self._pinned)
        if not non_blocking:
            self._synchronize()
        for entry in chosen:
            entry.device_views = [tensor.data for tensor in entry.tensors]
            for tensor in entry.tensors:
                tensor.data = _typed_view(tensor, host_storage, entry.offset)
            entry.storage.resize_(0)
            self._moved[id(entry)] = entry
        return sum(entry.nbytes for entry in chosen)

    def reload(self, non_blocking=False):
        """Bring every moved storage back to the device, in place; returns the bytes moved."""
        moved = 0
        for entry in self._moved.values():
            entry.storage.resize_(entry.nbytes)
            host = self._host.narrow(0, entry.offset, entry.nbytes)
            _bytes_view(entry.storage, self.device).copy_(host, non_blocking=self._pinned)
            for tensor, view in zip(entry.tensors, entry.device_views):
                tensor.data = view
            entry.device_views = []
            moved += entry.nbytes
        self._moved = {}
        if not non_blocking:
            self._synchronize()
        return moved

    def _synchronize(self):
        if self.device.type != "cpu":
            get_accelerator().synchronize()

    def _host_buffer(self, numel, pin_memory):
        """The uint8 host buffer of ``numel`` bytes: the kept one where it fits and holds nothing; grown (the
        storages on the host already copied over and their tensors pointed at the copy) when it holds some."""
        pin = bool(pin_memory) and self.device.type != "cpu" and get_accelerator().is_available()
        keep = self._host
        if keep is not None and not self._moved and keep.numel() >= numel and self._pinned == pin:
            return keep
        fresh = _pinned_bytes(numel) if pin else torch.empty(numel, dtype=torch.uint8)
        if self._moved:
            if self.device.type != "cpu":  # copies into the kept buffer may still be in flight
                get_accelerator().synchronize()
            fresh.narrow(0, 0, keep.numel()).copy_(keep)
            for entry in self._moved.values():
                for tensor, view in zip(entry.tensors, entry.device_views):
                    tensor.data = _typed_view(view, fresh.untyped_storage(), entry.offset)
        self._host = fresh
        self._pinned = pin
        return fresh
