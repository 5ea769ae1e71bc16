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

On a machine without CUDA (or for tensors on the CPU) the copies are plain synchronous
copies and the handles are already complete, so callers need no second code path.
"""

import torch


class Transfer:
    """The completion of one copy (or of nothing, for a synchronous copy)."""

    __slots__ = ("event", )

    def __init__(self, event=None):
        self.event = event

    def synchronize(self):
        """Block the host until the copy is done (a host destination may be read afterwards)."""
        if self.event is not None:
            self.event.synchronize()

    def wait_stream(self, stream=None):
        """Make ``stream`` (default: the current one) wait for the copy, without blocking the host."""
        if self.event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self.event)

    def done(self):
        return self.event is None or self.event.query()


DONE = Transfer()


class HostTransfers:
    """Copies between ``device`` and host memory on one side stream (see the module docstring)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def copy(self, dst, src):
        """Start ``dst.copy_(src)`` where one side is on the device and the other on the host."""
        if self.stream is None or (dst.device.type != "cuda" and src.device.type != "cuda"):
            dst.copy_(src)
            return DONE
        producer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(producer)
            dst.copy_(src, non_blocking=True)
            for tensor in (src, dst):
                if tensor.device.type == "cuda":
                    tensor.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return Transfer(event)


def pinned(tensor, pin_memory=True):
    """``tensor`` on the host, page-locked when asked for and a GPU exists (it is returned as is otherwise)."""
    if pin_memory and tensor.device.type == "cpu" and torch.cuda.is_available() and not tensor.is_pinned():
        return tensor.pin_memory()
    return tensor


class PinnedRing:
    """``count`` host buffers of ``numel`` elements, handed out in turn; a buffer is reused only after its copy.

    ``take(numel)`` returns a view of the next buffer (``numel`` at most the buffer size) and
    waits for the transfer that last used it, so pinned memory stays bounded by
    ``count * numel`` however many copies are in flight.
    """

    def __init__(self, count, numel, dtype, pin_memory=True):
        self.buffers = [pinned(torch.empty(max(int(numel), 1), dtype=dtype), pin_memory) for _ in range(count)]
        self._last = [DONE] * count
        self._next = 0

    @property
    def numel(self):
        return self.buffers[0].numel()

    def take(self, numel):
        if numel > self.numel:
            raise ValueError(f"PinnedRing: asked for {numel} elements, buffers hold {self.numel}")
        index = self._next
        self._next = (index + 1) % len(self.buffers)
        self._last[index].synchronize()
        self._last[index] = DONE
        return index, self.buffers[index].narrow(0, 0, numel)

    def used_by(self, index, transfer):
        """Record that buffer ``index`` is in use until ``transfer`` completes."""
        self._last[index] = transfer
