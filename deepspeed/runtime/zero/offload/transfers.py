# SPDX-License-Identifier: Apache-2.0
"""Device <-> host copies for offload: a side stream, events, and a bounded ring of pinned buffers.

Note on ordering. A copy issued here runs on the transfer stream, after everything the
caller's (compute) stream had queued when the copy was issued: the copy reads what the
compute stream wrote. The source is recorded on the transfer stream, so the caching
allocator does not hand its memory to another tensor before the copy has read it.
Whoever consumes the destination waits for the copy's event: the host with
:meth:`Transfer.synchronize` (before reading a host tensor), a device stream with
:meth:`Transfer.wait_stream` (before reading a device tensor). Nothing here blocks the
host except those two calls.

A host buffer that a copy reads (an upload) or writes (a download) must not be touched by
the host until that copy completed: whoever reuses such a buffer synchronizes the copy
first (:class:`PinnedRing` does it for its buffers).

On a machine without CUDA (or for tensors on the CPU) the copies are plain synchronous
copies and the handles are already complete, so callers need no second code path.
``DS_OFFLOAD_SYNC=1`` in the environment makes every copy a plain blocking one on CUDA
too (the reference the pinned/stream path is tested against).
"""

import contextlib
import os

import torch


def synchronous_copies():
    """Whether copies must be plain blocking ones (``DS_OFFLOAD_SYNC=1``)."""
    return os.environ.get("DS_OFFLOAD_SYNC", "") == "1"


class Transfer:
    """The completion of one copy (or of nothing, for a synchronous copy).

    ``stream`` is the side stream the copy ran on (None for a synchronous copy): work queued
    there afterwards, a collective launched under :meth:`ordered` for instance, runs after it
    without the compute stream waiting.
    """

    __slots__ = ("event", "stream")

    def __init__(self, event=None, stream=None):
        self.event = event
        self.stream = stream

    def synchronize(self):
        """Block the host until the copy is done (a host destination may be read afterwards)."""
        if self.event is not None:
            self.event.synchronize()

    def wait_stream(self, stream=None):
        """Make ``stream`` (default: the current one) wait for the copy, without blocking the host."""
        if self.event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self.event)

    def wait(self):
        """A work handle's ``wait()``: the current stream waits for the copy (the transport's ``wait`` calls it)."""
        self.wait_stream()

    def ordered(self):
        """A context whose device work runs after the copy, on its stream (a no-op context when already done)."""
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def done(self):
        return self.event is None or self.event.query()


DONE = Transfer()


class HostTransfers:
    """Copies between ``device`` and host memory on one side stream (see the module docstring)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = None
        if self.device.type == "cuda" and not synchronous_copies():
            self.stream = torch.cuda.Stream(self.device)

    def copy(self, dst, src, wait_producer=True):
        """Start ``dst.copy_(src)`` where one side is on the device and the other on the host.

        The copy runs after what the calling thread's current stream queued so far; ``wait_producer=False``
        skips that wait (a host thread that queues no device work, after :meth:`after_current`)."""
        if self.stream is None or (dst.device.type != "cuda" and src.device.type != "cuda"):
            dst.copy_(src)
            return DONE
        producer = torch.cuda.current_stream(self.device)  # read before the context makes the side stream current
        with torch.cuda.stream(self.stream):
            if wait_producer:
                self.stream.wait_stream(producer)
            dst.copy_(src, non_blocking=True)
            for tensor in (src, dst):
                if tensor.device.type == "cuda":
                    tensor.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return Transfer(event, self.stream)

    def after_current(self):
        """Later copies run after everything the calling thread's current stream queued so far."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy_many(self, pairs):
        """Start ``dst.copy_(src)`` for every ``(dst, src)`` of ``pairs`` in order; one handle for all of them."""
        last = DONE
        for dst, src in pairs:
            last = self.copy(dst, src)
        return last  # copies on one stream complete in order

    def synchronize(self):
        """Block the host until every copy issued so far is done."""
        if self.stream is not None:
            self.stream.synchronize()


def pinned(tensor, pin_memory=True):
    """``tensor`` on the host, page-locked when asked for and a GPU exists (it is returned as is otherwise)."""
    if pin_memory and tensor.device.type == "cpu" and torch.cuda.is_available() and not tensor.is_pinned():
        return tensor.pin_memory()
    return tensor


def pinned_empty(numel, dtype, pin_memory=True):
    """A new flat host tensor of ``numel`` elements, allocated page-locked when asked for and a GPU exists."""
    if pin_memory and torch.cuda.is_available():
        return torch.empty(int(numel), dtype=dtype, pin_memory=True)
    return torch.empty(int(numel), dtype=dtype)


def is_page_locked(tensor):
    """Whether an asynchronous copy to or from ``tensor`` can overlap the host (a pinned host tensor)."""
    return tensor.device.type == "cpu" and torch.cuda.is_available() and tensor.is_pinned()


class PinnedRing:
    """At most ``count`` host buffers of ``numel`` elements, handed out in turn; a buffer is reused after its copy.

    ``take(numel)`` returns a view of the next buffer (``numel`` at most the buffer size) and
    waits for the transfer that last used it, so pinned memory stays bounded by
    ``count * numel`` however many copies are in flight. Anything with a ``synchronize()``
    may mark a buffer in use (a copy's :class:`Transfer`, a host task; with ``done()`` too, the ring can tell that
    it completed without waiting).

    Buffers are allocated as they are needed: one at first, another only when the next one in turn is still in use
    and fewer than ``count`` exist. So the ring holds the most buffers ever in use at once, not ``count`` of them:
    where the consumer keeps up (the host adds of a gradient fold, a shard upload), a few buffers instead of the
    whole ring (on the 0.5e9-parameter NVMe benchmark, the folds' ring would otherwise pin 32 x 32 MiB).
    """

    def __init__(self, count, numel, dtype, pin_memory=True):
        self.count = max(int(count), 1)
        self._args = (max(int(numel), 1), dtype, pin_memory)
        self.buffers = [pinned_empty(*self._args)]
        self._last = [DONE]
        self._next = 0

    @property
    def numel(self):
        return self.buffers[0].numel()

    @property
    def dtype(self):
        return self.buffers[0].dtype

    def _busy(self, index):
        last = self._last[index]
        if last is DONE:
            return False
        done = getattr(last, "done", None)
        return done is None or not done()

    def take(self, numel):
        if numel > self.numel:
            raise ValueError(f"PinnedRing: asked for {numel} elements, buffers hold {self.numel}")
        index = self._next
        if self._busy(index) and len(self.buffers) < self.count:
            index = len(self.buffers)
            self.buffers.append(pinned_empty(*self._args))
            self._last.append(DONE)
        self._next = (index + 1) % len(self.buffers)
        self._last[index].synchronize()
        self._last[index] = DONE
        return index, self.buffers[index].narrow(0, 0, numel)

    def used_by(self, index, transfer):
        """Record that buffer ``index`` is in use until ``transfer`` completes."""
        self._last[index] = transfer

    def synchronize(self):
        """Block until no buffer is in use."""
        for index, last in enumerate(self._last):
            last.synchronize()
            self._last[index] = DONE
