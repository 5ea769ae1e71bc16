# SPDX-License-Identifier: Apache-2.0
"""What one ``engine.step()`` of ZenFlow does, counted, and that the host step overlaps the steps after it.

Upstream's accounting (every ``engine.step()`` a ZenFlow step, a host step every ``update_interval`` of them)
requires per step: the device part's Adam step and the step's clipped gradient added into the window; per
window: one host step. Counted here on CPU, deterministically, for both places the window sums:

* ZeRO-2 without ``zenflow.offload``: the gradient partitions stay on the device; every step adds on the
  device, nothing is copied to the host per step (no host pass, no selected gradient copied up), and each window's
  sum reaches the host once;
* ZeRO-2 with ``zenflow.offload`` and ZeRO-3: the partitions are on the host; every step is one host accumulation
  and one copy of the selected gradient to the device.

Overlap (``overlap_step``): the host step launched when a window closes is held on the worker (it waits for an
event); the next window's steps but its last must all complete while it is held (none waits for it, on either
path), and the window's last step, which applies it (upstream's rule), completes once it is released. The
parameters are compared with the run in which nothing was held.
"""

import copy
import threading

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.zenflow.test_zenflow import ZFNet, batch, config, loss_of

UPDATE = 4
WINDOWS = 3


def _engine(stage, offload):
    import deepspeed
    torch.manual_seed(0)
    model = ZFNet()
    zenflow = dict(topk_ratio=0.3, update_interval=UPDATE, overlap_step=True, offload=offload)
    return deepspeed.initialize(model=copy.deepcopy(model), config=config(stage, 1, zenflow))[0]


def _step(engine, step):
    engine.backward(loss_of(engine, *batch(0, step, 0)))
    engine.step()


def count_work(stage, offload):
    """The ZenFlow counters after every engine.step() of ``WINDOWS`` windows."""
    engine = _engine(stage, offload)
    zenflow = engine._stage.zenflow
    rows = []
    try:
        for step in range(UPDATE * WINDOWS):
            _step(engine, step)
            zenflow.window.wait()
            rows.append(dict(zenflow.counts, **zenflow.window.counts))
    finally:
        engine.destroy()
    return rows


@pytest.mark.parametrize("stage,offload", [(2, False), (2, True), (3, False)])
def test_work_per_engine_step(stage, offload):
    rows = run_distributed(count_work, 1, args=(stage, offload), timeout=60)[0]
    on_device = stage == 2 and not offload
    for t, row in enumerate(rows):
        n = t + 1
        assert row["steps"] == n
        assert row["host_steps"] == n // UPDATE, (t, row)  # one host step per window, launched at its last step
        if on_device:
            assert (row["device_accumulations"], row["host_accumulations"]) == (n, 0), (t, row)
            assert row["selected_grad_copies"] == 0, (t, row)
            assert row["sum_copies"] == n // UPDATE, (t, row)  # the window's sum reaches the host once
        else:
            assert (row["device_accumulations"], row["host_accumulations"]) == (0, n), (t, row)
            assert row["selected_grad_copies"] == n, (t, row)
            assert row["sum_copies"] == 0, (t, row)


class _HeldHostStep:
    """A host step that waits for ``release`` before stepping (the first one only: later waits return at once)."""

    def __init__(self, host_step, release):
        self._inner = host_step
        self._release = release

    def step(self, **kwargs):
        self._release.wait(timeout=20)
        return self._inner.step(**kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def overlap_run(stage, offload, hold):
    """Two windows; with ``hold`` the first host step waits until the second window's steps but its last ran.
    Returns (whether the held step was still running after those steps, the model's parameters)."""
    engine = _engine(stage, offload)
    window = engine._stage.zenflow.window
    release = threading.Event()
    if not hold:
        release.set()
    window.host_step = _HeldHostStep(window.host_step, release)
    still_running = None
    try:
        for step in range(UPDATE):
            _step(engine, step)
        launched = window.launched
        assert launched is not None
        for step in range(UPDATE, 2 * UPDATE - 1):  # none of these may wait for the held host step
            _step(engine, step)
        still_running = not launched.done()
        release.set()
        _step(engine, 2 * UPDATE - 1)  # applies it (the next window closes)
        window.wait()
        values = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    finally:
        release.set()
        engine.destroy()
    return still_running, values


def overlap_held_and_free(stage, offload):
    return overlap_run(stage, offload, True), overlap_run(stage, offload, False)


@pytest.mark.parametrize("stage,offload", [(2, False), (2, True), (3, False)])
def test_host_step_overlaps_the_next_window(stage, offload):
    held, free = run_distributed(overlap_held_and_free, 1, args=(stage, offload), timeout=90)[0]
    assert held[0] is True, "a step of the next window waited for the host step"
    for name, value in held[1].items():
        assert torch.equal(value, free[1][name]), name
