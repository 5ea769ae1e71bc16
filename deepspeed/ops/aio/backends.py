# SPDX-License-Identifier: Apache-2.0
"""The two engines behind an aio handle: the compiled op's I/O threads, and the same on Python threads.

Both take raw host addresses and have one contract (the compiled one is documented in ``csrc/aio/ds_aio.cpp``):

* ``submit(write, address, nbytes, path, fd, offset)`` queues one request and returns its id; a file that cannot be
  opened raises :class:`AsyncIOError` at once and queues nothing;
* the request is cut into blocks of ``block_size`` bytes (rounded up to :data:`ALIGNMENT`), at most
  ``queue_depth * intra_op_parallelism`` blocks (64 at most) in the kernel at once, each moved with
  ``pread``/``pwrite``; files are opened with ``O_DIRECT`` where the address and the offset are aligned (a file
  system that refuses it gets buffered I/O, counted by ``direct_refused()``), unaligned blocks through a buffered
  descriptor, and closed when the request completes;
* ``wait_op(id)`` waits for one request, ``wait_all()`` for all of them and returns how many of those not waited for
  one by one completed since the last ``wait_all()``; a failed request (errno, file, offset; a read past the end of
  the file) raises :class:`AsyncIOError` from whichever wait reports it first. Waiting releases the GIL.

:func:`open_io` picks the compiled op when it loads (``deepspeed.ops.native.load_op``), Python threads otherwise
(``DS_AIO_BACKEND=python`` forces them). ``DS_AIO_INJECT_FAULT=<read|write|direct>:<after>:<errno>`` makes every new
handle fail that kind of block (``direct``: ``O_DIRECT`` opens) with that errno after ``after`` successful ones (the
fault tests use it: ``write:N:28`` is a disk that fills, ``direct:0:22`` a file system that refuses ``O_DIRECT``).
"""

import ctypes
import errno as errno_codes
import os
import re
import threading
from collections import deque

ALIGNMENT = 4096
MAX_THREADS = 64


class AsyncIOError(OSError):
    """A read or write of the aio handle failed (the message names the file, the offset and the errno; ``errno`` is
    the failed call's, ``ENOSPC`` for a full disk, or ``EIO`` where none applies, as for a short read)."""

    def __init__(self, message):
        match = re.search(r"\(errno (\d+)\)", message)
        super().__init__(int(match.group(1)) if match else errno_codes.EIO, message)


def _aligned(value):
    return value % ALIGNMENT == 0


def _errno_text(error):
    return f"{os.strerror(error)} (errno {error})"


def io_block_bytes(block_size):
    """The block size the engines use: ``block_size`` rounded up to :data:`ALIGNMENT`."""
    return -(-int(block_size) // ALIGNMENT) * ALIGNMENT


FAULT_KINDS = {"read": 0, "write": 1, "direct": 2}


def parse_fault(spec):
    """``"write:3:28"`` -> ``(1, 3, 28)`` (kind, after, errno); None for an empty spec; ValueError for a malformed
    one."""
    if not spec:
        return None
    try:
        kind, after, error = spec.split(":")
        return FAULT_KINDS[kind], int(after), int(error)
    except (ValueError, KeyError):
        raise ValueError(f"DS_AIO_INJECT_FAULT={spec!r}: expected <read|write|direct>:<after>:<errno>") from None


class _Request:
    __slots__ = ("id", "write", "address", "nbytes", "offset", "path", "direct_fd", "buffered_fd", "owns_fds",
                 "blocks_left", "error")

    def __init__(self, write, address, nbytes, offset, path):
        self.id = -1
        self.write = write
        self.address = address
        self.nbytes = nbytes
        self.offset = offset
        self.path = path
        self.direct_fd = -1
        self.buffered_fd = -1
        self.owns_fds = True
        self.blocks_left = 0
        self.error = ""


class ThreadIO:
    """The aio engine on Python threads (see the module docstring): ``os.pread``/``os.pwrite`` release the GIL, so
    the threads move bytes in parallel; what they cost over the compiled op is a few microseconds per block."""

    backend = "python"

    def __init__(self, block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism):
        if min(int(block_size), int(queue_depth), int(intra_op_parallelism)) < 1:
            raise ValueError("aio handle: block_size, queue_depth and intra_op_parallelism must be >= 1")
        self.block_size = int(block_size)
        self.queue_depth = int(queue_depth)
        self.single_submit = bool(single_submit)
        self.overlap_events = bool(overlap_events)
        self.intra_op_parallelism = int(intra_op_parallelism)
        self.threads = min(MAX_THREADS, self.queue_depth * self.intra_op_parallelism)
        self._io_block = io_block_bytes(self.block_size)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._done = threading.Condition(self._lock)
        self._queue = deque()
        self._workers = []
        self._busy = 0
        self._pending = set()
        self._errors = {}
        self._next_id = 0
        self._completed = set()  # completed, not yet reported by wait_op or counted by wait_all
        self._direct_refused = 0
        self._stopping = False
        self._fault = None  # [write, after, errno]

    # -------------------------------------------------------------- submission
    def _open(self, request, flags, direct):
        try:
            if direct:
                with self._lock:
                    fault = self._fault
                    if fault is not None and fault[0] == FAULT_KINDS["direct"]:
                        if fault[1] > 0:
                            fault[1] -= 1
                        else:
                            raise OSError(fault[2], os.strerror(fault[2]))
            return os.open(request.path, flags | (os.O_DIRECT if direct else 0) | os.O_CLOEXEC, 0o644)
        except OSError as error:
            if direct and error.errno == errno_codes.EINVAL:
                with self._lock:
                    self._direct_refused += 1
                return -1
            raise AsyncIOError(f"aio: cannot open {request.path}: {_errno_text(error.errno)}") from None

    def submit(self, write, address, nbytes, path, fd, offset):
        """Queue one request; returns its id (see the module docstring)."""
        if nbytes < 0 or offset < 0:
            raise AsyncIOError("aio: negative size or offset")
        request = _Request(bool(write), int(address), int(nbytes), int(offset), str(path))
        base_aligned = _aligned(request.address) and _aligned(request.offset)
        if fd is not None and fd >= 0:
            request.buffered_fd, request.owns_fds = int(fd), False
        else:
            flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
            if base_aligned and nbytes >= ALIGNMENT:
                request.direct_fd = self._open(request, flags, True)
            if not (base_aligned and _aligned(nbytes)) or request.direct_fd < 0:
                try:
                    request.buffered_fd = self._open(request, flags, False)
                except AsyncIOError:
                    self._close(request)
                    raise
        blocks = []
        for start in range(0, request.nbytes, self._io_block):
            length = min(self._io_block, request.nbytes - start)
            blocks.append((request, start, length, request.direct_fd >= 0 and _aligned(length)))
        with self._lock:
            if self._stopping:
                self._close(request)
                raise AsyncIOError("aio: the handle is closed")
            request.id = self._next_id
            self._next_id += 1
            if not blocks:
                self._completed.add(request.id)
                self._close(request)
                return request.id
            request.blocks_left = len(blocks)
            self._pending.add(request.id)
            self._queue.extend(blocks)
            while len(self._workers) < self.threads and len(self._workers) < len(self._queue) + self._busy:
                worker = threading.Thread(target=self._run, name="ds-aio", daemon=True)
                worker.start()
                self._workers.append(worker)
            self._work.notify_all()
        return request.id

    @staticmethod
    def _close(request):
        if request.owns_fds:
            for fd in (request.direct_fd, request.buffered_fd):
                if fd >= 0:
                    os.close(fd)
        request.direct_fd = request.buffered_fd = -1

    # ------------------------------------------------------------------ I/O
    def _run(self):
        while True:
            with self._lock:
                while not self._stopping and not self._queue:
                    self._work.wait()
                if not self._queue:
                    return
                block = self._queue.popleft()
                self._busy += 1
                injected = 0
                fault = self._fault
                if fault is not None and fault[0] == FAULT_KINDS["write" if block[0].write else "read"]:
                    if fault[1] > 0:
                        fault[1] -= 1
                    else:
                        injected = fault[2]
            request, start, length, direct = block
            if injected:
                error = self._describe(request, request.offset + start, injected)
            else:
                error = self._transfer(request, start, length, direct)
            self._finish(request, error)

    @staticmethod
    def _describe(request, at, error):
        verb = "write to" if request.write else "read from"
        return f"aio: {verb} {request.path} at byte {at} failed: {_errno_text(error)}"

    def _transfer(self, request, start, length, direct):
        fd = request.direct_fd if direct else request.buffered_fd
        view = memoryview((ctypes.c_char * length).from_address(request.address + start)).cast("B")
        at = request.offset + start
        done = 0
        while done < length:
            try:
                if request.write:
                    n = os.pwrite(fd, view[done:], at)
                else:
                    n = os.preadv(fd, [view[done:]], at)
            except InterruptedError:
                continue
            except OSError as error:
                return self._describe(request, at, error.errno)
            if n == 0:
                if request.write:
                    return self._describe(request, at, errno_codes.EIO)
                size = os.fstat(fd).st_size
                return (f"aio: short read from {request.path}: the file ends at byte {size}, the request reads bytes "
                        f"[{request.offset}, {request.offset + request.nbytes})")
            done += n
            at += n
        return ""

    def _finish(self, request, error):
        with self._lock:
            self._busy -= 1
            if error and not request.error:
                request.error = error
            request.blocks_left -= 1
            if request.blocks_left == 0:
                self._close(request)
                self._pending.discard(request.id)
                self._completed.add(request.id)
                if request.error:
                    self._errors[request.id] = request.error
                self._done.notify_all()

    # ------------------------------------------------------------ completion
    def wait_op(self, request_id):
        with self._lock:
            while request_id in self._pending:
                self._done.wait()
            self._completed.discard(request_id)
            error = self._errors.pop(request_id, "")
        if error:
            raise AsyncIOError(error)

    def wait_all(self):
        with self._lock:
            while self._pending:
                self._done.wait()
            count = len(self._completed)
            self._completed.clear()
            errors = [self._errors[k] for k in sorted(self._errors)]
            self._errors.clear()
        if errors:
            more = f" (and {len(errors) - 1} more failed requests)" if len(errors) > 1 else ""
            raise AsyncIOError(errors[0] + more)
        return count

    def pending(self):
        with self._lock:
            return len(self._pending)

    def is_done(self, request_id):
        """Whether request ``request_id`` is no longer in flight (waiting for it would not block)."""
        with self._lock:
            return request_id not in self._pending

    def direct_refused(self):
        with self._lock:
            return self._direct_refused

    def inject_fault(self, kind, after, error):
        """After ``after`` more successful ones, fail blocks of ``kind`` (:data:`FAULT_KINDS`) with ``error``."""
        with self._lock:
            self._fault = [int(kind), int(after), int(error)] if error else None

    def close(self):
        with self._lock:
            while self._pending:
                self._done.wait()
            self._stopping = True
            self._work.notify_all()
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.join()


class NativeIO:
    """The compiled op (``csrc/aio/ds_aio.cpp``, a ``ctypes.CDLL``) under the :class:`ThreadIO` interface."""

    backend = "native"
    _ERRLEN = 1024

    def __init__(self, library, block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism):
        self._lib = bind(library)
        err = ctypes.create_string_buffer(self._ERRLEN)
        handle = self._lib.ds_aio_create(int(block_size), int(queue_depth), int(bool(single_submit)),
                                         int(bool(overlap_events)), int(intra_op_parallelism), err, self._ERRLEN)
        if not handle:
            raise ValueError(err.value.decode(errors="replace"))
        self._handle = ctypes.c_void_p(handle)
        self.block_size = int(block_size)
        self.queue_depth = int(queue_depth)
        self.single_submit = bool(single_submit)
        self.overlap_events = bool(overlap_events)
        self.intra_op_parallelism = int(intra_op_parallelism)
        self.threads = self._lib.ds_aio_threads(self._handle)

    def submit(self, write, address, nbytes, path, fd, offset):
        err = ctypes.create_string_buffer(self._ERRLEN)
        request_id = self._lib.ds_aio_submit(self._handle, int(bool(write)), int(address), int(nbytes),
                                             os.fsencode(path), -1 if fd is None else int(fd), int(offset), err,
                                             self._ERRLEN)
        if request_id < 0:
            raise AsyncIOError(err.value.decode(errors="replace"))
        return request_id

    def wait_op(self, request_id):
        err = ctypes.create_string_buffer(self._ERRLEN)
        if self._lib.ds_aio_wait_op(self._handle, int(request_id), err, self._ERRLEN):
            raise AsyncIOError(err.value.decode(errors="replace"))

    def wait_all(self):
        err = ctypes.create_string_buffer(self._ERRLEN)
        failed = ctypes.c_int(0)
        count = self._lib.ds_aio_wait_all(self._handle, err, self._ERRLEN, ctypes.byref(failed))
        if failed.value:
            raise AsyncIOError(err.value.decode(errors="replace"))
        return count

    def pending(self):
        return self._lib.ds_aio_pending(self._handle)

    def is_done(self, request_id):
        return bool(self._lib.ds_aio_is_done(self._handle, int(request_id)))

    def direct_refused(self):
        return self._lib.ds_aio_direct_refused(self._handle)

    def inject_fault(self, kind, after, error):
        self._lib.ds_aio_inject_fault(self._handle, int(kind), int(after), int(error))

    def close(self):
        if self._handle is not None:
            self._lib.ds_aio_shutdown(self._handle)

    def __del__(self):
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None:
            self._lib.ds_aio_destroy(handle)


def bind(library):
    """Declare the argument and result types of the op's C functions on ``library`` (once)."""
    if getattr(library, "_ds_bound", False):
        return library
    c_int64, c_void_p, c_char_p, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
    signatures = {
        "ds_aio_create": (c_void_p, [c_int64, c_int64, c_int, c_int, c_int64, c_char_p, c_int64]),
        "ds_aio_destroy": (None, [c_void_p]),
        "ds_aio_threads": (c_int64, [c_void_p]),
        "ds_aio_submit":
        (c_int64, [c_void_p, c_int, ctypes.c_uint64, c_int64, c_char_p, c_int, c_int64, c_char_p, c_int64]),
        "ds_aio_wait_op": (c_int, [c_void_p, c_int64, c_char_p, c_int64]),
        "ds_aio_wait_all": (c_int64, [c_void_p, c_char_p, c_int64, ctypes.POINTER(c_int)]),
        "ds_aio_pending": (c_int64, [c_void_p]),
        "ds_aio_is_done": (c_int, [c_void_p, c_int64]),
        "ds_aio_direct_refused": (c_int64, [c_void_p]),
        "ds_aio_inject_fault": (None, [c_void_p, c_int, c_int64, c_int]),
        "ds_aio_shutdown": (None, [c_void_p]),
        "ds_aio_alignment": (c_int64, []),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    if library.ds_aio_alignment() != ALIGNMENT:
        raise RuntimeError(f"the async_io op aligns to {library.ds_aio_alignment()} bytes, this module to {ALIGNMENT}")
    library._ds_bound = True
    return library


class _CompiledOp:
    """``AsyncIOBuilder`` as ``load_op`` takes it: ``load()`` gives the compiled op, not the front module."""

    name = "async_io"

    def load(self, verbose=True):
        from deepspeed.ops.op_builder.async_io import AsyncIOBuilder
        return AsyncIOBuilder().load_native(verbose)


def native_op():
    """The compiled op's module, or None (no compiler, a failed build, or ``DS_AIO_BACKEND=python``)."""
    if os.environ.get("DS_AIO_BACKEND", "").lower() == "python":
        return None
    from deepspeed.ops.native import load_op
    return load_op(_CompiledOp(), "the aio handle")


def open_io(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism, backend=None):
    """An aio engine: the compiled op unless ``backend == "python"`` or it does not load here."""
    op = None if backend == "python" else native_op()
    if backend == "native" and op is None:
        raise RuntimeError("the async_io op cannot be loaded here (see ds_report)")
    args = (block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)
    engine = NativeIO(op, *args) if op is not None else ThreadIO(*args)
    fault = parse_fault(os.environ.get("DS_AIO_INJECT_FAULT", ""))
    if fault is not None:
        engine.inject_fault(*fault)
    return engine
