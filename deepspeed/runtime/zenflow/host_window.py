# SPDX-License-Identifier: Apache-2.0
"""ZenFlow's host part: the window sum and the asynchronous host optimizer step.

Every ZenFlow step hands :meth:`HostWindow.accumulate` the step's gradient (the stage's
partitions) and its clipping coefficient; the window sum ``acc`` receives ``coef * gradient``
(the first step of a window overwrites it). At the end of a window :meth:`launch` queues the
host step on a :class:`~deepspeed.runtime.zero.offload.host_worker.HostWorker` thread: the masters'
gradient is ``acc / n`` (the mean of the window's clipped gradients), the inner optimizer steps
every host master element (the elements the device part owns get values nobody reads: the
device part's values replace them), and its 16-bit values land in the pinned upload buffers of
the stage's :class:`~deepspeed.runtime.zero.offload.offload_step.HostStep`.

Where the window sums (``device``):

* on the device (ZeRO 1/2 without ``zenflow.offload``: the stage keeps its gradient partitions
  there): each accumulation is one device operation on the compute stream, nothing reaches the
  host per step. :meth:`launch` divides the sum by ``n`` on the device, copies it once into
  pinned host buffers on a side stream, and the host step waits for that copy on the worker.
  The next window's first accumulation makes the compute stream wait for the copy (it
  overwrites the sum the copy reads). Costs device memory: the fp32 sum of the rank's partition.
* on the host (``device`` None: ZeRO-3, or ``zenflow.offload``): an accumulation worker thread
  adds each step's host partitions into the sum while the device goes on; the partitions stay in
  use until that task completed (the stage gives the next step's gradient the other of two
  partition sets). Two sums alternate between windows, so a window accumulates while the host
  step of the previous one reads the other sum: accumulations never queue behind a host step.
  A sum is overwritten only after the host step that read it completed.

Either way the host step of a window runs during the following steps (``overlap_step``): the
worker that runs host steps runs nothing else.

How far that step moves (``zenflow.window_update``): Adam's step size does not grow with
the gradient, so one step per window moves the unselected elements about ``n`` times slower
than the selected ones, which take the window's ``n`` steps. "scaled" takes
one Adam step with ``n`` times each group's learning rate (decoupled weight decay, which the
learning rate multiplies, then decays as ``n`` steps would); "repeat" takes ``n`` Adam steps
with the same mean gradient (``n`` host passes; the moments see the mean ``n`` times);
"sqrt" one Adam step with ``sqrt(n)`` times the learning rate (the square-root rule for a
batch ``n`` times larger, right where the gradient noise dominates: the window's mean has
``1/n`` of a step's variance); "once" one plain step. The inner optimizer's step count (its
bias correction) counts the Adam steps it took: one per window ("scaled", "sqrt", "once") or
``n`` ("repeat").

The step runs on a *snapshot* of the optimizer (the same state and parameters, copies of the
param-group dicts taken at launch), so the hyperparameters are those of the launching step,
whatever an LR scheduler does to the live dicts meanwhile.

:attr:`HostWindow.counts` counts the work (accumulations on the host and on the device, host
steps, copies of the sum to the host); :attr:`HostWindow.busy` the worker threads' seconds.
"""

import math
import time

import torch

from deepspeed.runtime.zenflow.config import WINDOW_UPDATES
from deepspeed.runtime.zero.offload.host_worker import HostWorker
from deepspeed.runtime.zero.offload.transfers import DONE, HostTransfers, pinned


def optimizer_snapshot(optimizer):
    """An object that steps ``optimizer``'s parameters and state with copies of its current param-group dicts."""
    proxy = object.__new__(type(optimizer))
    proxy.__dict__.update(optimizer.__dict__)
    proxy.param_groups = [dict(group) for group in optimizer.param_groups]
    return proxy


def _add_scaled(acc, parts, coef, first):
    """``acc (+)= coef * parts`` (the first step of a window overwrites)."""
    for a, part in zip(acc, parts):
        if not first:
            a.add_(part, alpha=coef)
        elif part.dtype == a.dtype:
            torch.mul(part, coef, out=a)
        else:
            a.copy_(part).mul_(coef)


class HostWindow:
    """The window sum and the host step (see the module docstring). ``device``: where the window sums (None: on
    the host)."""

    def __init__(self, host_step, *, threads, update="once", device=None, pin_memory=True):
        if update not in WINDOW_UPDATES:
            raise ValueError(f"zenflow.window_update must be one of {list(WINDOW_UPDATES)}, got {update!r}")
        self.update = update
        self.optimizer = host_step.optimizer
        self.masters = host_step.masters
        self.host_step = host_step
        self.threads = threads
        self.device = None if device is None else torch.device(device)
        self.worker = HostWorker("ds-zenflow-host", threads)  # host steps only
        if self.device is None:
            self.acc_worker = HostWorker("ds-zenflow-acc", threads)
            self._sums = [[torch.zeros_like(m.data) for m in self.masters] for _ in range(2)]
            self._readers = [None, None]  # the host step (a HostTask) that reads each sum
            self._host_grads = None
        else:
            self.acc_worker = None
            self.transfers = HostTransfers(self.device)
            self._sums = [[torch.zeros(m.shape, dtype=torch.float32, device=self.device) for m in self.masters]]
            self._host_grads = [pinned(torch.zeros_like(m.data), pin_memory) for m in self.masters]
            self._copied = DONE  # the last copy of the sum to the host
        self._current = 0  # the sum the open window writes
        self._last_add = DONE  # the open window's last accumulation task (host)
        self.count = 0  # steps accumulated in the open window
        self.launched = None  # the task of the last host step
        self.counts = dict(host_accumulations=0, device_accumulations=0, host_steps=0, sum_copies=0)
        self.busy = dict(accumulate_s=0.0, host_step_s=0.0)

    @property
    def acc(self):
        """The open window's sum (one tensor per group; on the window's device)."""
        return self._sums[self._current]

    def accumulate(self, parts, coef):
        """``acc (+)= coef * parts``; returns the task after which ``parts`` are free again (DONE on the device)."""
        first = self.count == 0
        self.count += 1
        acc = self.acc
        if self.device is not None:
            if first:
                self._copied.wait_stream()  # the previous sum has reached the host
            _add_scaled(acc, parts, coef, first)
            self.counts["device_accumulations"] += 1
            return DONE
        reader = self._readers[self._current] if first else None
        busy = self.busy

        def run():
            if reader is not None:
                reader.wait_done()  # the host step that read this sum two windows ago (its error is its own)
            start = time.perf_counter()
            _add_scaled(acc, parts, coef, first)
            busy["accumulate_s"] += time.perf_counter() - start

        self.counts["host_accumulations"] += 1
        self._last_add = self.acc_worker.submit(run)
        return self._last_add

    def launch(self):
        """Queue the host step of the open window (mean of its accumulated gradients, moved as ``update`` says); the
        window closes."""
        n, self.count = self.count, 0
        proxy = optimizer_snapshot(self.optimizer)
        passes = 1
        if self.update == "scaled" and n > 1:
            for group in proxy.param_groups:
                group["lr"] = group["lr"] * n
        elif self.update == "sqrt" and n > 1:
            for group in proxy.param_groups:
                group["lr"] = group["lr"] * math.sqrt(n)
        elif self.update == "repeat":
            passes = n
        acc = self.acc
        if self.device is not None:
            if n > 1:
                for a in acc:
                    a.mul_(1.0 / n)
            self._copied = self.transfers.copy_many(list(zip(self._host_grads, acc)))
            self.counts["sum_copies"] += 1
            grads, ready, scale = self._host_grads, self._copied, 1
        else:
            grads, ready, scale = acc, self._last_add, n
        masters, host_step, threads, busy = self.masters, self.host_step, self.threads, self.busy

        def run():
            ready.synchronize()  # the window's last accumulation, or the copy of its sum
            start = time.perf_counter()
            for master, g in zip(masters, grads):
                if scale > 1:
                    g.mul_(1.0 / scale)
                master.grad = g
            try:
                for _ in range(passes):
                    host_step.step(optimizer=proxy, threads_n=threads)
            finally:
                for master in masters:
                    master.grad = None
                busy["host_step_s"] += time.perf_counter() - start

        self.launched = self.worker.submit(run)
        self.counts["host_steps"] += 1
        if self.device is None:
            self._readers[self._current] = self.launched
            self._current = 1 - self._current
        return self.launched

    def wait(self):
        """Block until everything queued completed (raising what a task raised)."""
        if self.acc_worker is not None:
            self.acc_worker.drain()
        self.worker.drain()
        if self.device is not None:
            self._copied.synchronize()

    def idle(self):
        return self.worker.idle() and (self.acc_worker is None or self.acc_worker.idle())

    def close(self):
        if self.acc_worker is not None:
            self.acc_worker.close()
        self.worker.close()
