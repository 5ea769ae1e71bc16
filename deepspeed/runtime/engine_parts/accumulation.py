# SPDX-License-Identifier: Apache-2.0
"""The accumulation window's clock: micro-steps, the boundary, and deferred reduction.

One :class:`AccumulationWindow` per engine holds what the three accumulation protocols
need to know where a window ends:

1. native: ``backward`` + ``step()`` every micro-batch; the boundary is
   ``(micro_steps + 1) % GAS == 0``;
2. Accelerate: ``set_gradient_accumulation_boundary(flag)`` before each backward;
3. unmanaged (``managed_gradient_accumulation: false``): backward only accumulates,
   every ``step()`` is a boundary.

and whether reduction is deferred (``no_sync``, ``coalesce_grad_reduction``). The ZeRO
stage reads it as its clock (``gradient_accumulation_steps``, ``at_boundary``,
``deferred``) to decide whether a backward reduces.
"""

import contextlib


class AccumulationWindow:
    """See the module docstring."""

    def __init__(self, gradient_accumulation_steps, managed=True):
        self.gas = int(gradient_accumulation_steps)
        self.managed = bool(managed)
        self.micro_steps = 0
        self.boundary_flag = None  # set by the Accelerate protocol
        self.in_step = False
        self.no_sync_depth = 0
        self.coalesce_depth = 0
        self.window_start = 0  # micro_steps when the current GAS took effect

    def gradient_accumulation_steps(self):
        return self.gas

    def set_gradient_accumulation_steps(self, gas):
        """Windows from the next micro-step on have ``gas`` micro-steps (``set_train_batch_size``). Call it between
        windows: the window that follows has exactly ``gas`` micro-steps (counted from here)."""
        self.gas = int(gas)
        self.window_start = self.micro_steps

    def is_boundary(self):
        """Whether the current micro-step ends the window (``step()`` applies the optimizer)."""
        if not self.managed:
            return self.in_step
        if self.boundary_flag is None:
            return (self.micro_steps - self.window_start + 1) % self.gas == 0
        return self.boundary_flag

    def at_boundary(self):
        """Whether a backward running now is in the window's last micro-step (managed accumulation only)."""
        return self.managed and self.is_boundary()

    def deferred(self):
        """Whether reduction is deferred to the end of a ``no_sync``/``coalesce_grad_reduction`` context."""
        return self.no_sync_depth > 0 or self.coalesce_depth > 0

    @contextlib.contextmanager
    def stepping(self):
        """The body of ``engine.step()``: with unmanaged accumulation, every step is a boundary."""
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = False

    @contextlib.contextmanager
    def no_sync(self):
        self.no_sync_depth += 1
        try:
            yield
        finally:
            self.no_sync_depth -= 1

    @contextlib.contextmanager
    def coalesced(self):
        """Defer reduction; yields, and on leaving the outermost context says whether it should reduce now."""
        self.coalesce_depth += 1
        try:
            yield
        finally:
            self.coalesce_depth -= 1
