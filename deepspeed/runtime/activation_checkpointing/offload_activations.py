# SPDX-License-Identifier: Apache-2.0
"""The inputs of checkpointed layers wait in host memory between forward and backward (upstream's
``CheckpointHiddenStatesOffload``).

With every layer under non-reentrant activation checkpointing, what a model keeps on the device between forward and
backward is one input per layer. torch saves a checkpoint's inputs through the saved-tensor hooks active around the
checkpoint, so a ``saved_tensors_hooks`` context sees each of them once, in forward. This context offloads the ones
that were *marked*: ``mark(t)`` before the checkpoint, or, while the context is active, the ``hidden_states`` of every
HF ``GradientCheckpointingLayer`` that runs checkpointed in training (its ``__call__`` is wrapped for the time of the
context). Every other saved tensor passes through untouched. When the backward unpacks an offloaded input it is copied
back, into a tensor of the original size and strides.

* Only device tensors of at least ``min_offload_bytes`` that do not overlap themselves are offloaded; a marked tensor
  on the host (the CPU accelerator has no device memory to free), a smaller one or an overlapping view (a zero stride)
  stays where it is and counts as skipped.
* The last ``keep_last_count`` marked inputs stay on the device: the backward needs them first, before a copy back
  could arrive. An input is offloaded once ``keep_last_count`` newer ones were saved.
* With ``use_streams`` on an accelerator with streams, the copy to the host runs on a side stream that first waits
  for the compute stream; the device tensor is held (the forward stash) until its copy's event completed, at most
  ``max_fwd_stash_count`` of them (older copies are waited for). Without, the copy is queued on the compute stream,
  which orders every later use of the freed memory after it.
* Host buffers are contiguous, pinned through ``get_accelerator().pin_memory`` when ``use_pin_memory``, and reused
  by shape and dtype across steps (at most ``max_cpu_buffer_pool_count`` kept): a buffer goes back to the pool once
  its copy back completed.
* An input is restored once; a second backward over a retained graph gets the same restored tensor. Everything is
  released when the context exits.

``stats`` counts what happened (saved tensors seen, marked, offloaded, restored, skipped, kept on the device, bytes).
"""

import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from torch.autograd.graph import saved_tensors_hooks

from deepspeed.accelerator import get_accelerator

__all__ = [
    "CheckpointActivationOffloadStats", "CheckpointHiddenStatesOffload",
    "get_checkpoint_hidden_states_offloading_ctx_manager", "patch_gradient_checkpointing_layer_marker"
]


@dataclass
class CheckpointActivationOffloadStats:
    """What an offload context did (upstream's counters)."""
    saved_tensors_seen: int = 0
    marked_tensors: int = 0
    offloaded_tensors: int = 0
    restored_tensors: int = 0
    skipped_marked_tensors: int = 0
    kept_last_tensors: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0


class _Saved:
    """What the pack hook returns for a marked input: its number in this context."""
    __slots__ = ("index", )

    def __init__(self, index):
        self.index = index


@dataclass
class _HostCopy:
    buffer: torch.Tensor  # contiguous, on the host
    key: Tuple
    device: torch.device
    size: torch.Size
    stride: Tuple[int, ...]


# ---------------------------------------------------------------- the HF marker (one wrapper for every context)
_local = threading.local()  # each thread's stack of entered contexts: the innermost marks
_patch_lock = threading.Lock()
_patch_users = 0  # entered contexts relying on the wrapper
_patched_by_call = False  # patch_gradient_checkpointing_layer_marker() installed it for good
_original_call = None


def _contexts() -> List["CheckpointHiddenStatesOffload"]:
    if not hasattr(_local, "contexts"):
        _local.contexts = []
    return _local.contexts


def _gradient_checkpointing_layer():
    # Only a transformers already imported can have built layers to mark: importing it here would cost seconds.
    transformers = sys.modules.get("transformers")
    return getattr(transformers, "GradientCheckpointingLayer", None) if transformers is not None else None


def _install_marker() -> bool:
    global _original_call
    layer_cls = _gradient_checkpointing_layer()
    if layer_cls is None:
        return False
    if _original_call is None:
        original = layer_cls.__call__

        def marking_call(self, *args, **kwargs):
            contexts = _contexts()
            if contexts and getattr(self, "gradient_checkpointing", False) and self.training:
                hidden = args[0] if args else kwargs.get("hidden_states")
                if isinstance(hidden, torch.Tensor):
                    contexts[-1].mark(hidden)
            return original(self, *args, **kwargs)

        _original_call = original
        layer_cls.__call__ = marking_call
    return True


def _remove_marker():
    global _original_call
    layer_cls = _gradient_checkpointing_layer()
    if layer_cls is not None and _original_call is not None:
        layer_cls.__call__ = _original_call
    _original_call = None


def patch_gradient_checkpointing_layer_marker() -> None:
    """Wrap ``transformers.GradientCheckpointingLayer.__call__`` so that, inside an offload context, each
    checkpointed layer's ``hidden_states`` is marked; installed until the process ends (the contexts otherwise
    install it while they are active). Without transformers imported, nothing to do."""
    global _patched_by_call
    with _patch_lock:
        _patched_by_call = _install_marker() or _patched_by_call


class CheckpointHiddenStatesOffload(saved_tensors_hooks):
    """See the module docstring. Not re-entrant: one ``with`` at a time per object (nested contexts of different
    objects are fine; the innermost marks)."""

    def __init__(self,
                 use_pin_memory: bool = True,
                 use_streams: bool = True,
                 min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2,
                 max_cpu_buffer_pool_count: int = 64,
                 keep_last_count: int = 1) -> None:
        for name, value in (("keep_last_count", keep_last_count), ("max_fwd_stash_count", max_fwd_stash_count),
                            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count), ("min_offload_bytes",
                                                                                       min_offload_bytes)):
            if value < 0:
                raise ValueError(f"CheckpointHiddenStatesOffload: {name} must be >= 0, got {value}")
        super().__init__(self._pack, self._unpack)
        self.use_pin_memory = bool(use_pin_memory)
        self.min_offload_bytes = int(min_offload_bytes)
        self.max_fwd_stash_count = int(max_fwd_stash_count)
        self.max_cpu_buffer_pool_count = int(max_cpu_buffer_pool_count)
        self.keep_last_count = int(keep_last_count)
        accelerator = get_accelerator()
        self.use_streams = bool(use_streams) and not accelerator.is_synchronized_device()
        self._copy_stream = accelerator.Stream() if self.use_streams else None
        self.stats = CheckpointActivationOffloadStats()
        self._entered = False
        self._marked: Dict[int, weakref.ref] = {}  # id -> the tensor (not kept alive), until its first save
        self._next_id = 0
        self._keep_last: Dict[int, torch.Tensor] = {}  # the newest marked inputs, still on the device (oldest first)
        self._kept_counted = set()
        self._tracker: Dict[int, _HostCopy] = {}  # offloaded inputs
        self._fwd_stash: Dict[int, Tuple[torch.Tensor, object]] = {}  # device tensors held until their copy ends
        self._restored: Dict[int, torch.Tensor] = {}
        self._cpu_buffer_pool: Dict[Tuple, List[torch.Tensor]] = {}
        self._cpu_buffer_pool_count = 0
        self._returning: List[Tuple[Tuple, torch.Tensor, object]] = []  # buffers whose copy back may be in flight

    # ------------------------------------------------------------ marking
    def mark(self, tensor: torch.Tensor) -> None:
        """Offload ``tensor`` when autograd saves it next (a checkpoint's input)."""
        self._marked[id(tensor)] = weakref.ref(tensor)
        self.stats.marked_tensors += 1

    def _take_mark(self, tensor):
        marked = self._marked.get(id(tensor))
        if marked is not None and marked() is tensor:
            del self._marked[id(tensor)]
            return True
        return False

    # ------------------------------------------------------------ hooks
    def _offloadable(self, tensor) -> bool:
        """A device tensor that owns its elements once each (the host has no device memory to free)."""
        if tensor.device.type in ("cpu", "meta") or tensor.numel() == 0:
            return False
        if any(stride == 0 and size > 1 for size, stride in zip(tensor.size(), tensor.stride())):
            return False
        return tensor.numel() * tensor.element_size() >= self.min_offload_bytes

    def _pack(self, tensor):
        self.stats.saved_tensors_seen += 1
        if not self._take_mark(tensor):
            return tensor
        if not self._offloadable(tensor):
            self.stats.skipped_marked_tensors += 1
            return tensor
        self._next_id += 1
        index = self._next_id
        self._keep_last[index] = tensor
        while len(self._keep_last) > self.keep_last_count:
            oldest = next(iter(self._keep_last))
            self._offload(oldest, self._keep_last.pop(oldest))
        return _Saved(index)

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        index = saved.index
        if index in self._keep_last:
            if index not in self._kept_counted:
                self._kept_counted.add(index)
                self.stats.kept_last_tensors += 1
            return self._keep_last[index]
        restored = self._restored.get(index)
        if restored is None:
            restored = self._restore(index)
        return restored

    # ------------------------------------------------------------ copies
    @staticmethod
    def _buffer_key(tensor) -> Tuple:
        """Host buffers are contiguous: a shape and a dtype name one, whatever the source's strides."""
        return tuple(tensor.size()), tensor.dtype

    def _empty_cpu_like(self, tensor) -> Tuple[torch.Tensor, Tuple]:
        """A contiguous host buffer for ``tensor`` (from the pool when one of its shape and dtype is free)."""
        key = self._buffer_key(tensor)
        pooled = self._cpu_buffer_pool.get(key)
        if pooled:
            self._cpu_buffer_pool_count -= 1
            return pooled.pop(), key
        buffer = torch.empty(tensor.size(), dtype=tensor.dtype, device="cpu")
        if self.use_pin_memory:
            buffer = get_accelerator().pin_memory(buffer)
        return buffer, key

    def _offload(self, index, tensor):
        buffer, key = self._empty_cpu_like(tensor)
        accelerator = get_accelerator()
        non_blocking = accelerator.is_pinned(buffer)
        if self._copy_stream is not None:
            self._copy_stream.wait_stream(accelerator.current_stream())
            with accelerator.stream(self._copy_stream):
                buffer.copy_(tensor, non_blocking=non_blocking)
                event = accelerator.Event()
                event.record(self._copy_stream)
            self._fwd_stash[index] = (tensor, event)
            while len(self._fwd_stash) > self.max_fwd_stash_count:
                oldest = next(iter(self._fwd_stash))
                self._fwd_stash.pop(oldest)[1].synchronize()
        else:  # queued on the compute stream: the freed memory's next use follows the copy
            buffer.copy_(tensor, non_blocking=non_blocking)
        self._tracker[index] = _HostCopy(buffer, key, tensor.device, tensor.size(), tensor.stride())
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += tensor.numel() * tensor.element_size()

    def _restore(self, index):
        stashed = self._fwd_stash.pop(index, None)
        if stashed is not None:
            stashed[1].synchronize()  # the copy out must be complete before the buffer is read
        copy = self._tracker.pop(index)
        accelerator = get_accelerator()
        restored = torch.empty_strided(copy.size, copy.stride, dtype=copy.buffer.dtype, device=copy.device)
        restored.copy_(copy.buffer, non_blocking=accelerator.is_pinned(copy.buffer))
        event = None
        if copy.device.type != "cpu":
            event = accelerator.Event()
            event.record(accelerator.current_stream())
        self._returning.append((copy.key, copy.buffer, event))
        self._reap_returning()
        self._restored[index] = restored
        self.stats.restored_tensors += 1
        self.stats.restored_bytes += restored.numel() * restored.element_size()
        return restored

    def _reap_returning(self, wait=False):
        """Buffers whose copy back completed go back to the pool (up to its size)."""
        pending = []
        for key, buffer, event in self._returning:
            if event is not None and not wait and not event.query():
                pending.append((key, buffer, event))
                continue
            if event is not None and wait:
                event.synchronize()
            if self._cpu_buffer_pool_count < self.max_cpu_buffer_pool_count:
                self._cpu_buffer_pool.setdefault(key, []).append(buffer)
                self._cpu_buffer_pool_count += 1
        self._returning = pending

    def _release(self):
        for _, event in self._fwd_stash.values():
            event.synchronize()
        self._fwd_stash.clear()
        self._reap_returning(wait=True)
        self._marked.clear()
        self._keep_last.clear()
        self._kept_counted.clear()
        self._tracker.clear()
        self._restored.clear()

    # ------------------------------------------------------------ context
    def __enter__(self):
        global _patch_users
        if self._entered:
            raise RuntimeError("CheckpointHiddenStatesOffload is not re-entrant: exit it before entering it again")
        self._entered = True
        with _patch_lock:
            _install_marker()
            _patch_users += 1
        _contexts().append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        global _patch_users
        try:
            return super().__exit__(*exc)
        finally:
            contexts = _contexts()
            if self in contexts:
                contexts.remove(self)
            with _patch_lock:
                _patch_users -= 1
                if _patch_users == 0 and not _patched_by_call:
                    _remove_marker()
            self._release()
            self._entered = False


def get_checkpoint_hidden_states_offloading_ctx_manager(use_pin_memory: bool = True,
                                                        use_streams: bool = True,
                                                        min_offload_bytes: int = 1024,
                                                        max_fwd_stash_count: int = 2,
                                                        max_cpu_buffer_pool_count: int = 64,
                                                        keep_last_count: int = 1) -> CheckpointHiddenStatesOffload:
    """A :class:`CheckpointHiddenStatesOffload` with these settings (upstream's factory)."""
    return CheckpointHiddenStatesOffload(use_pin_memory=use_pin_memory,
                                         use_streams=use_streams,
                                         min_offload_bytes=min_offload_bytes,
                                         max_fwd_stash_count=max_fwd_stash_count,
                                         max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
                                         keep_last_count=keep_last_count)
