# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``async_io`` module (what ``AsyncIOBuilder().load()`` returns): ``aio_handle``, ``aio_read``,
``aio_write`` and ``deepspeed_memcpy``, on the engines of :mod:`deepspeed.ops.aio.backends`.

``aio_handle(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)`` takes upstream's
arguments and defaults. Its reads and writes move whole tensors (``buffer``) from or to a file at ``file_offset``:

* ``read``/``write(buffer, filename, validate, file_offset=0)``: synchronous, return 0;
* ``pread``/``pwrite(buffer, filename, validate, async, file_offset=0)``: return 0 when ``async`` (``wait()`` completes
  them), else the count of completed requests (1);
* ``sync_pread``/``sync_pwrite(buffer, filename, file_offset=0)``: synchronous, return 1;
* ``async_pread``/``async_pwrite(buffer, filename_or_fd, file_offset=0)``: return 0; ``wait()`` completes them;
* ``wait()``: blocks until every request submitted completed and returns how many completed since the last
  ``wait()`` (0 when nothing was queued); a failed request raises :class:`AsyncIOError`;
* ``new_cpu_locked_tensor(num_elem, example_tensor)`` (aligned, page-locked where a GPU is),
  ``free_cpu_locked_tensor(tensor)``, ``is_pinned(tensor)``, and the getters.

``validate`` compares the tensor with the file as plain Python file I/O reads it, after the request completed
(``AsyncIOError`` on a difference). The handle keeps a reference to every tensor in flight, so one cannot be
freed under a request. A tensor on a GPU goes through a host copy: written from a copy taken at submission, read into
a host buffer copied to the device when the request completes. Every blocking call releases the GIL while it waits.
Writes never truncate a file: pieces written at offsets compose one file.
"""

import os
import threading

import torch

from deepspeed.ops.aio.backends import ALIGNMENT, AsyncIOError, open_io
from deepspeed.ops.aio.buffers import aligned_empty, free_aligned, host_address

__all__ = ["aio_handle", "aio_read", "aio_write", "deepspeed_memcpy", "AsyncIOError"]


class aio_handle:  # noqa: N801 (upstream's name)
    """Asynchronous reads and writes of tensors to files (see the module docstring)."""

    def __init__(self,
                 block_size=1024 * 1024,
                 queue_depth=128,
                 single_submit=False,
                 overlap_events=False,
                 intra_op_parallelism=1,
                 backend=None):
        self._io = open_io(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism, backend)
        self._lock = threading.Lock()
        self._inflight = {}  # request id -> (tensor kept alive, finisher run when it completed, or None)

    # ---------------------------------------------------------------- getters
    def get_block_size(self):
        return self._io.block_size

    def get_queue_depth(self):
        return self._io.queue_depth

    def get_single_submit(self):
        return self._io.single_submit

    def get_overlap_events(self):
        return self._io.overlap_events

    def get_intra_op_parallelism(self):
        return self._io.intra_op_parallelism

    def get_alignment(self):
        """The alignment (bytes) of buffers and offsets that ``O_DIRECT`` takes; others go through the page cache."""
        return ALIGNMENT

    @property
    def backend(self):
        """``"native"`` (the compiled op) or ``"python"`` (Python threads)."""
        return self._io.backend

    def direct_refused(self):
        """How many opens the file system refused ``O_DIRECT`` for (those requests used buffered I/O)."""
        return self._io.direct_refused()

    # ------------------------------------------------------------- requests
    def _submit(self, write, buffer, target, file_offset, validate=False):
        """Queue one request for the whole of ``buffer``; returns its id."""
        finishers = []
        host = buffer
        if isinstance(buffer, torch.Tensor) and buffer.device.type != "cpu":
            if not buffer.is_contiguous():
                raise ValueError("aio: the tensor must be contiguous")
            host = aligned_empty(buffer.numel(), buffer.dtype)
            if write:
                host.copy_(buffer.reshape(-1))
            else:
                finishers.append(lambda device=buffer, host=host: device.copy_(host.view(device.shape)))

        address = host_address(host)
        nbytes = host.numel() * host.element_size()
        fd = target if isinstance(target, int) else None
        path = f"<fd {target}>" if fd is not None else os.fspath(target)
        if validate:
            finishers.append(lambda: _validate(write, host, path, fd, file_offset))
        finisher = (lambda: [f() for f in finishers]) if finishers else None
        request_id = self._io.submit(write, address, nbytes, path, fd, int(file_offset))
        with self._lock:
            self._inflight[request_id] = (host, buffer, finisher)
        return request_id

    def _complete(self, request_ids):
        """Drop the references of completed requests and run their finishers."""
        with self._lock:
            entries = [self._inflight.pop(i, None) for i in request_ids]
        for entry in entries:
            if entry is not None and entry[2] is not None:
                entry[2]()

    def _run_sync(self, write, buffer, target, file_offset, validate=False):
        request_id = self._submit(write, buffer, target, file_offset, validate)
        try:
            self._io.wait_op(request_id)
        finally:
            with self._lock:
                entry = self._inflight.pop(request_id, None)
        if entry is not None and entry[2] is not None:
            entry[2]()
        return 1

    def read(self, buffer, filename, validate, file_offset=0):
        """Read ``buffer`` from ``filename`` at ``file_offset`` and wait; returns 0."""
        self._run_sync(False, buffer, filename, file_offset, validate)
        return 0

    def write(self, buffer, filename, validate, file_offset=0):
        """Write ``buffer`` to ``filename`` at ``file_offset`` and wait; returns 0."""
        self._run_sync(True, buffer, filename, file_offset, validate)
        return 0

    def pread(self, buffer, filename, validate, async_op, file_offset=0):
        """Read; with ``async_op`` return 0 at once (``wait()`` completes it), else wait and return 1."""
        if async_op:
            self._submit(False, buffer, filename, file_offset, validate)
            return 0
        return self._run_sync(False, buffer, filename, file_offset, validate)

    def pwrite(self, buffer, filename, validate, async_op, file_offset=0):
        """Write; with ``async_op`` return 0 at once (``wait()`` completes it), else wait and return 1."""
        if async_op:
            self._submit(True, buffer, filename, file_offset, validate)
            return 0
        return self._run_sync(True, buffer, filename, file_offset, validate)

    def sync_pread(self, buffer, filename, file_offset=0):
        return self._run_sync(False, buffer, filename, file_offset)

    def sync_pwrite(self, buffer, filename, file_offset=0):
        return self._run_sync(True, buffer, filename, file_offset)

    def async_pread(self, buffer, filename, file_offset=0):
        self._submit(False, buffer, filename, file_offset)
        return 0

    def async_pwrite(self, buffer, filename, file_offset=0):
        """``filename`` may be an open file descriptor (an int): it is used as is and not closed."""
        self._submit(True, buffer, filename, file_offset)
        return 0

    def wait(self):
        """Block until every request completed; the count completed since the last ``wait()`` (0 if none)."""
        try:
            count = self._io.wait_all()
        finally:
            with self._lock:
                ids = list(self._inflight)
            self._complete(ids)
        return count

    def pending(self):
        """Requests submitted and not completed yet."""
        return self._io.pending()

    # -------------------------------------------------------------- buffers
    def new_cpu_locked_tensor(self, num_elem, example_tensor):
        """A flat CPU tensor of ``num_elem`` elements of ``example_tensor``'s dtype, aligned for ``O_DIRECT`` and
        page-locked where a GPU is."""
        return aligned_empty(int(num_elem), example_tensor.dtype)

    def free_cpu_locked_tensor(self, tensor):
        free_aligned(tensor)
        return True

    def is_pinned(self, tensor):
        """Whether ``tensor`` moves without a bounce copy: on the CPU and aligned for ``O_DIRECT``."""
        return tensor.device.type == "cpu" and tensor.data_ptr() % ALIGNMENT == 0

    def close(self):
        """Complete what is in flight and stop the I/O threads; the handle takes no request afterwards."""
        try:
            self.wait()
        finally:
            self._io.close()

    def __del__(self):
        io = getattr(self, "_io", None)
        if io is not None:
            try:
                io.close()
            except Exception:
                pass


def _validate(write, host, path, fd, file_offset):
    nbytes = host.numel() * host.element_size()
    if fd is not None:
        data = os.pread(fd, nbytes, file_offset)
    else:
        with open(path, "rb") as handle:
            handle.seek(file_offset)
            data = handle.read(nbytes)
    if data != host.view(torch.uint8).numpy().tobytes():
        verb = "write to" if write else "read from"
        raise AsyncIOError(f"aio: validation of the {verb} {path} at byte {file_offset} failed: the "
                           f"file's {len(data)} bytes differ from the tensor's {nbytes}")


def _one_shot(write, buffer, filename, block_size, queue_depth, single_submit, overlap_events, validate):
    handle = aio_handle(block_size, queue_depth, single_submit, overlap_events, 1)
    try:
        return handle.write(buffer, filename, validate) if write else handle.read(buffer, filename, validate)
    finally:
        handle._io.close()


def aio_read(buffer, filename, block_size, queue_depth, single_submit, overlap_events, validate):
    """Read ``buffer`` from ``filename`` with a handle of these settings; returns 0."""
    return _one_shot(False, buffer, filename, block_size, queue_depth, single_submit, overlap_events, validate)


def aio_write(buffer, filename, block_size, queue_depth, single_submit, overlap_events, validate):
    """Write ``buffer`` to ``filename`` with a handle of these settings; returns 0."""
    return _one_shot(True, buffer, filename, block_size, queue_depth, single_submit, overlap_events, validate)


def deepspeed_memcpy(dest, src):
    """``dest.copy_(src)`` (upstream's multithreaded copy); returns 0."""
    with torch.no_grad():
        dest.copy_(src)
    return 0
