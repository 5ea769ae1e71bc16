# SPDX-License-Identifier: Apache-2.0
"""``disable_python_gc``: Python's automatic cyclic garbage collection off while an engine that asks for it lives.

As upstream: ``deepspeed.initialize`` of an engine with ``"disable_python_gc": true`` acquires the process-wide
:data:`python_gc_manager`. The first such engine runs one full collection and turns automatic collection off
(``gc.disable()``); ``engine.destroy()`` releases it, and when the last such engine is gone automatic collection is
turned back on, if it was on before. ``engine.collect_python_gc()`` runs a collection at a point the training loop
chooses (the usual pattern: every N steps), without changing the policy. Reference counting still frees every
object that is not in a cycle; what waits for the explicit collection are cycles (and their memory).

A process forked while an engine holds the manager (a data-loader worker) starts with automatic collection as it
was before the engine, and holds nothing.
"""

import gc
import os
import threading

from deepspeed.utils.logging import logger


class PythonGCManager:
    """Counts the engines that asked for automatic collection off; see the module docstring."""

    def __init__(self):
        self._lock = threading.RLock()
        self._holders = 0
        self._was_enabled = False
        self._generation = 0  # bumped in a forked child: releases of the parent's engines do nothing there
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(before=self._lock.acquire,
                                after_in_parent=self._lock.release,
                                after_in_child=self._after_fork_child)

    def _after_fork_child(self):
        if self._holders > 0 and self._was_enabled:
            gc.enable()
        self._holders = 0
        self._was_enabled = False
        self._generation += 1
        self._lock = threading.RLock()

    def acquire(self):
        """One more engine wants automatic collection off; returns the token :meth:`release` takes."""
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                if self._was_enabled:
                    collected = gc.collect()
                    gc.disable()
                    logger.info(f"disable_python_gc: automatic garbage collection is off (collected {collected} "
                                f"objects first); call engine.collect_python_gc() to collect")
            self._holders += 1
            return self._generation

    def release(self, token):
        """The engine of ``token`` is gone; the last one turns automatic collection back on (if it was on)."""
        with self._lock:
            if token != self._generation or self._holders == 0:
                return
            self._holders -= 1
            if self._holders == 0:
                restore, self._was_enabled = self._was_enabled, False
                if restore and not gc.isenabled():
                    gc.enable()
                    logger.info("disable_python_gc: automatic garbage collection is on again")

    def collect(self):
        """A full collection now; the number of unreachable objects found."""
        return gc.collect()

    @property
    def active_engines(self):
        with self._lock:
            return self._holders


python_gc_manager = PythonGCManager()
