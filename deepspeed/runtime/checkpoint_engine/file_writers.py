# SPDX-License-Identifier: Apache-2.0
"""The file objects ``torch.save`` writes a checkpoint file through, and the operating system's error behind a
failed write.

Why our own file objects: torch's zip serializer calls ``write`` on the file object and, when that raises, reports
only its own inconsistency (``RuntimeError: [enforce fail at inline_container.cc] unexpected pos ...``): the
``OSError`` that said the disk is full is lost. Every call that reaches the operating system here (``write``,
``flush``, ``fsync``, ``close``) goes through :class:`_OsErrors`, which keeps the first ``OSError`` with the file's
path; :func:`serialize` re-raises it in place of whatever torch made of it, and, when no call failed visibly,
asks the file system (``statvfs``) whether it is full.

* :class:`PythonFileWriter` (``checkpoint.writer.type: python``, and the torch writer): a buffered Python file.
* :class:`FastFileWriter` (``type: fast``): bytes are copied into one of two aligned host buffers of
  ``io_buffer_size`` bytes and written by the ``async_io`` op (``O_DIRECT`` where the file system takes it) while the
  serializer fills the other (``io_buffer_double``; a single buffer waits for its own write).

Both end with ``fsync``: when :meth:`close` returns, the bytes are on the device. Neither has ``fileno`` (torch then
writes every byte through ``write``).

Test hook: ``DS_CHECKPOINT_TEST_WRITE_FAULT=<after_bytes>:<errno>`` makes a write fail with that errno once a file
has taken ``after_bytes`` bytes (``0:28``: a disk with no space left), below torch's serializer, where a real
``ENOSPC`` surfaces.
"""

import ctypes
import errno as errno_codes
import os
import time

import torch

WRITE_FAULT_ENV = "DS_CHECKPOINT_TEST_WRITE_FAULT"
# below this many free bytes a failed save is taken for a full file system
NEARLY_FULL_BYTES = 1 << 20


def _injected_fault():
    spec = os.environ.get(WRITE_FAULT_ENV, "")
    if not spec:
        return None
    after, _, code = spec.partition(":")
    return int(after), int(code or errno_codes.ENOSPC)


class _OsErrors:
    """Runs the calls that reach the operating system; keeps the first ``OSError`` (with the file's path)."""

    def __init__(self, path):
        self.path = path
        self.error = None
        self.bytes_written = 0
        self.seconds = 0.0
        self._fault = _injected_fault()

    def call(self, fn, *args):
        try:
            return fn(*args)
        except OSError as exc:
            if exc.filename is None:
                exc = OSError(exc.errno, exc.strerror or str(exc), self.path)
            if self.error is None:
                self.error = exc
            raise exc

    def check_fault(self, nbytes):
        if self._fault is not None and self.bytes_written + nbytes > self._fault[0]:
            self.call(self._raise_fault)

    def _raise_fault(self):
        code = self._fault[1]
        raise OSError(code, os.strerror(code), self.path)


class PythonFileWriter:
    """A buffered Python file opened for writing at ``path`` (see the module docstring)."""

    def __init__(self, path, buffer_size=8 << 20):
        self.os = _OsErrors(path)
        self._file = self.os.call(open, path, "wb", buffer_size)

    def write(self, data):
        view = memoryview(data).cast("B")
        self.os.check_fault(view.nbytes)
        start = time.perf_counter()
        self.os.call(self._file.write, view)
        self.os.seconds += time.perf_counter() - start
        self.os.bytes_written += view.nbytes
        return view.nbytes

    def flush(self):
        self.os.call(self._file.flush)

    def close(self):
        """Flush, ``fsync`` and close; the first failure raises (the file is closed either way)."""
        if self._file is None:
            return
        handle, self._file = self._file, None
        try:
            start = time.perf_counter()
            self.os.call(handle.flush)
            self.os.call(os.fsync, handle.fileno())
            self.os.seconds += time.perf_counter() - start
        finally:
            try:
                self.os.call(handle.close)
            except OSError:
                if self.os.error is None:
                    raise

    def abort(self):
        """Close without syncing (the file is about to be removed)."""
        if self._file is not None:
            handle, self._file = self._file, None
            try:
                handle.close()
            except OSError:
                pass


class FastFileWriter:
    """Writes through the ``async_io`` op from aligned host buffers (see the module docstring).

    ``handle`` is an ``aio_handle``; ``buffers`` one or two aligned uint8 tensors of equal size, owned by the
    caller and reused file after file.
    """

    def __init__(self, path, handle, buffers):
        self.os = _OsErrors(path)
        self._handle = handle
        self._buffers = list(buffers)
        # plain memory views of the buffers: a slice assignment is one memcpy (torch's copy_ of a uint8 view over
        # foreign bytes measured ten times slower)
        self._views = [memoryview((ctypes.c_char * b.numel()).from_address(b.data_ptr())).cast("B") for b in buffers]
        self._fd = self.os.call(os.open, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._current = 0
        self._fill = 0
        self._offset = 0  # file offset of the current buffer's first byte
        self._in_flight = [False] * len(self._buffers)

    def _wait(self):
        start = time.perf_counter()
        try:
            self.os.call(self._handle.wait)
        finally:
            self.os.seconds += time.perf_counter() - start
            self._in_flight = [False] * len(self._buffers)

    def _drain(self):
        """Submit the current buffer's bytes; go on with the other buffer (waiting for its previous write)."""
        if self._fill == 0:
            return
        self.os.check_fault(self._fill)
        buffer = self._buffers[self._current]
        self.os.call(self._handle.async_pwrite, buffer.narrow(0, 0, self._fill), self._fd, self._offset)
        self._in_flight[self._current] = True
        self.os.bytes_written += self._fill
        self._offset += self._fill
        self._fill = 0
        self._current = (self._current + 1) % len(self._buffers)
        if self._in_flight[self._current]:
            self._wait()

    def write(self, data):
        view = memoryview(data).cast("B")
        total = view.nbytes
        done = 0
        while done < total:
            target = self._views[self._current]
            n = min(total - done, target.nbytes - self._fill)
            target[self._fill:self._fill + n] = view[done:done + n]
            self._fill += n
            done += n
            if self._fill == target.nbytes:
                self._drain()
        return total

    def flush(self):
        pass  # bytes leave at a full buffer or at close: a flush mid-file would break the aligned offsets

    def close(self):
        if self._fd is None:
            return
        try:
            self._drain()
            self._wait()
            start = time.perf_counter()
            self.os.call(os.fsync, self._fd)
            self.os.seconds += time.perf_counter() - start
        finally:
            fd, self._fd = self._fd, None
            os.close(fd)

    def abort(self):
        if self._fd is not None:
            try:
                self._handle.wait()
            except OSError:
                pass
            fd, self._fd = self._fd, None
            os.close(fd)


def full_disk_error(path):
    """``OSError(ENOSPC)`` naming ``path`` when its file system has (nearly) no space left, else None."""
    try:
        stats = os.statvfs(os.path.dirname(path) or ".")
    except OSError:
        return None
    if stats.f_bavail * stats.f_frsize < NEARLY_FULL_BYTES:
        return OSError(errno_codes.ENOSPC, os.strerror(errno_codes.ENOSPC), path)
    return None


def serialize(obj, file_writer, zipfile=True):
    """``torch.save(obj)`` through ``file_writer``, closed (synced) after; on failure the operating system's error
    (see the module docstring) is raised, else torch's own. A view of a larger buffer is written as its own bytes,
    not the buffer's (``compaction``)."""
    from deepspeed.runtime.checkpoint_engine.compaction import compact_views
    try:
        torch.save(compact_views(obj), file_writer, _use_new_zipfile_serialization=zipfile)
        file_writer.close()
    except BaseException as exc:
        file_writer.abort()
        os_error = file_writer.os.error or (full_disk_error(file_writer.os.path)
                                            if not isinstance(exc, OSError) else None)
        if os_error is not None and os_error is not exc:
            raise os_error from exc
        raise
