# SPDX-License-Identifier: Apache-2.0
"""``disable_python_gc``: automatic cyclic collection is off while an engine that asks for it lives, on again when
the last one is destroyed; ``engine.collect_python_gc()`` collects cycles at the caller's chosen point."""

import gc
import weakref

import torch

from tests.unit.common import run_distributed


def _engine(disable):
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if disable is not None:
        cfg["disable_python_gc"] = disable
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


class _Cycle:

    def __init__(self):
        self.me = self


def gc_worker():
    assert gc.isenabled()
    plain = _engine(None)
    off = _engine(False)
    assert gc.isenabled(), "an engine without disable_python_gc changed the collector"
    first, second = _engine(True), _engine(True)
    states = [gc.isenabled()]
    cycle = _Cycle()
    ref = weakref.ref(cycle)
    del cycle
    for _ in range(3000):  # allocations that trigger automatic collections when the collector is on
        _Cycle()
    states.append(ref() is not None)
    assert first.collect_python_gc() >= 1 and ref() is None
    first.destroy()
    states.append(gc.isenabled())
    second.destroy()
    states.append(gc.isenabled())
    plain.destroy()
    off.destroy()
    return states


def test_disable_python_gc_as_upstream():
    assert run_distributed(gc_worker, 2, timeout=60) == [[False, True, False, True]] * 2


def test_manager_restores_a_collector_that_was_off():
    from deepspeed.runtime.python_gc import PythonGCManager
    manager = PythonGCManager()
    gc.disable()
    try:
        token = manager.acquire()
        assert not gc.isenabled() and manager.active_engines == 1
        manager.release(token)
        assert not gc.isenabled() and manager.active_engines == 0  # it was off before: stays off
    finally:
        gc.enable()
    token = manager.acquire()
    manager.release(token)
    manager.release(token)  # a second release is ignored
    assert gc.isenabled() and manager.active_engines == 0
