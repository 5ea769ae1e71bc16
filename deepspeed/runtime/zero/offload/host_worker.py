# SPDX-License-Identifier: Apache-2.0
"""A host thread that runs offload work (gradient adds, optimizer steps) while the caller goes on.

:class:`HostWorker` runs submitted callables one after another, in submission order, on
one background thread whose torch intra-op pool has its own size (``threads``): the
caller keeps its own cores for launching device work. Torch releases the GIL inside its
kernels, so a worker adding gradients on the host runs beside a Python thread that
drives the backward.

Each :meth:`HostWorker.submit` returns a :class:`HostTask`, which has the interface of a
copy's :class:`~deepspeed.runtime.zero.offload.transfers.Transfer` (``synchronize()``, ``done()``), so
a pinned buffer can be marked in use until a host task that reads it completed. An
exception raised by a task is kept and raised again, on the caller's thread, by the
next ``synchronize()`` of that task or by :meth:`HostWorker.drain`; the tasks after it
still run (each is independent), so a failure is reported, never lost.
"""

import os
import queue
import threading

import torch


def host_cores():
    """The CPU cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def cores_for(fraction):
    """``fraction`` of this process's cores, at least one."""
    return max(1, int(round(float(fraction) * host_cores())))


class threads:
    """Run a block with ``n`` torch intra-op threads on the calling thread, then restore the previous count."""

    def __init__(self, n):
        self.n = max(1, int(n))
        self._before = None

    def __enter__(self):
        self._before = torch.get_num_threads()
        if self._before != self.n:
            torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc):
        if torch.get_num_threads() != self._before:
            torch.set_num_threads(self._before)
        return False


class HostTask:
    """The completion of one submitted callable (see the module docstring)."""

    __slots__ = ("_event", "_error", "result")

    def __init__(self):
        self._event = threading.Event()
        self._error = None
        self.result = None

    def synchronize(self):
        self._event.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def done(self):
        return self._event.is_set()

    def wait_done(self):
        """Block until it ran, leaving an error it raised to ``synchronize()`` or the worker's ``drain()``."""
        self._event.wait()


class HostWorker:
    """One background thread running submitted callables in order (see the module docstring)."""

    def __init__(self, name, threads):
        self.name = name
        self.threads = max(1, int(threads))
        self._queue = queue.Queue()
        self._tasks = []
        self._thread = None
        self._lock = threading.Lock()

    def _ensure_thread(self):
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def _run(self):
        torch.set_num_threads(self.threads)
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, task = item
            try:
                with torch.no_grad():
                    task.result = fn()
            except BaseException as exc:  # reported to the caller by synchronize() / drain()
                task._error = exc
            finally:
                task._event.set()

    def submit(self, fn):
        """Queue ``fn()`` behind everything submitted before; returns its :class:`HostTask`."""
        task = HostTask()
        with self._lock:
            self._ensure_thread()
            self._tasks.append(task)
            if len(self._tasks) > 64:  # forget the completed ones, keep the failed ones until drained
                self._tasks = [t for t in self._tasks if not t.done() or t._error is not None]
        self._queue.put((fn, task))
        return task

    def drain(self):
        """Block until every submitted task completed; raise the first error one of them raised."""
        with self._lock:
            tasks, self._tasks = self._tasks, []
        first = None
        for task in tasks:
            try:
                task.synchronize()
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first

    def idle(self):
        """Whether nothing submitted is still pending."""
        with self._lock:
            return all(task.done() for task in self._tasks)

    def close(self):
        """Finish what was submitted and stop the thread."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._thread = None
