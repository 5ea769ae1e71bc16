# SPDX-License-Identifier: Apache-2.0
"""ZenFlow's host part: the window accumulator and the asynchronous host optimizer step.

Every ZenFlow step hands :meth:`HostWindow.accumulate` the step's window gradient (the host
partitions) and its clipping coefficient; a :class:`~deepspeed.runtime.zero.host_worker.HostWorker`
thread adds ``coef * gradient`` into the accumulator ``acc`` (the first step of a window
overwrites it) while the device goes on. The partitions stay in use until that task
completed; the stage gives the next step's gradient the other of two partition sets.

At the end of a window :meth:`launch` queues the host step on the same thread: the masters'
gradient is ``acc / n`` (the mean of the window's clipped gradients), the inner optimizer
steps every host master element (the elements the device part owns get values nobody reads:
the device part's values replace them), and its 16-bit values land in the pinned upload
buffers of the stage's :class:`~deepspeed.runtime.zero.offload_step.HostStep`.

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
whatever an LR scheduler does to the live dicts meanwhile. One thread runs accumulations and steps in
order, so the next window's first accumulation waits for the step that reads ``acc``.
"""

import math

import torch

from deepspeed.runtime.zenflow.config import WINDOW_UPDATES
from deepspeed.runtime.zero.host_worker import HostWorker


def optimizer_snapshot(optimizer):
    """An object that steps ``optimizer``'s parameters and state with copies of its current param-group dicts."""
    proxy = object.__new__(type(optimizer))
    proxy.__dict__.update(optimizer.__dict__)
    proxy.param_groups = [dict(group) for group in optimizer.param_groups]
    return proxy


class HostWindow:
    """Accumulates the host part over a window and steps it on a worker thread (see the module docstring)."""

    def __init__(self, host_step, *, threads, update="once"):
        if update not in WINDOW_UPDATES:
            raise ValueError(f"zenflow.window_update must be one of {list(WINDOW_UPDATES)}, got {update!r}")
        self.update = update
        self.optimizer = host_step.optimizer
        self.masters = host_step.masters
        self.host_step = host_step
        self.threads = threads
        self.worker = HostWorker("ds-zenflow-host", threads)
        self.acc = [torch.zeros_like(m.data) for m in self.masters]
        self.count = 0  # steps accumulated in the open window
        self.launched = None  # the task of the last host step

    def accumulate(self, parts, coef):
        """Queue ``acc (+)= coef * parts``; returns the task after which ``parts`` are free again."""
        first = self.count == 0
        self.count += 1
        acc = self.acc

        def run():
            for a, part in zip(acc, parts):
                if not first:
                    a.add_(part, alpha=coef)
                elif part.dtype == a.dtype:
                    torch.mul(part, coef, out=a)
                else:
                    a.copy_(part).mul_(coef)

        return self.worker.submit(run)

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
        masters, acc, host_step, threads = self.masters, self.acc, self.host_step, self.threads

        def run():
            for master, a in zip(masters, acc):
                if n > 1:
                    a.mul_(1.0 / n)
                master.grad = a
            try:
                for _ in range(passes):
                    host_step.step(optimizer=proxy, threads_n=threads)
            finally:
                for master in masters:
                    master.grad = None

        self.launched = self.worker.submit(run)
        return self.launched

    def wait(self):
        """Block until everything queued completed (raising what a task raised)."""
        self.worker.drain()

    def idle(self):
        return self.worker.idle()

    def close(self):
        self.worker.close()
