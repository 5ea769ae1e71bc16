# SPDX-License-Identifier: Apache-2.0
"""Run the gradient audit over the contract's graph shapes.

A contract shape (``tests/unit/contract/shapes.py``) is written once against a driver. To
audit it, the shape is run a second time, inside ``loss_fn``, against :class:`LossDriver`:
its forwards go through the engines (the audit calls ``loss_fn`` under ``torch.no_grad``) and
its backward calls add their loss to a total instead, with the weight the gradient contract
gives that call for the audited engine ``E``: ``s_c(E) * GAS_E``, i.e. 1, or ``GAS_E`` with
``scale_wrt_gas=False`` (the audit divides the window's sum by ``GAS_E``). A non-scalar
``out.backward(grad)`` is the loss ``sum(out * grad)``; a ``zero_grad`` drops the total so far
(and the runner drops the window's earlier micro-steps).

Several engines: the loss of ``E`` is a function of ``E``'s parameters with the other engines'
parameters as they were in that micro-step. An engine with a shorter window may have stepped
since (GAS 1 beside GAS 2): its forward is then not run again; the driver returns the output
it gave in training (recorded, detached), which is what the training's graph held.

:func:`run_audit_cell` trains a cell of the contract matrix and, at every boundary of every
engine, before ``step()``: completes the window, snapshots the gradient, the fp32 weights,
the model's parameters and the random generators, runs the audit, and checks that all of
them are bit for bit as before. It returns every report (as plain tuples, to compare ranks).
"""

import math

import torch


class LossDriver:
    """The driver interface of ``tests.unit.contract.drivers``; sums the micro-step's loss for engine ``target``.

    ``recorded``: the training forwards of this micro-step, ``[(engine index, its global_steps then, output)]``.
    """

    def __init__(self, engines, target, recorded):
        self.engines = engines
        self.models = [e.module for e in engines]
        self.gas = [e.gradient_accumulation_steps() for e in engines]
        self.target = target
        self.total = None
        self._recorded = list(recorded)
        self._calls = 0

    def _add(self, loss, scale_wrt_gas):
        weight = 1.0 if scale_wrt_gas else float(self.gas[self.target])
        term = loss.float() * weight
        self.total = term if self.total is None else self.total + term

    def fwd(self, i, *args, **kwargs):
        engine, steps, output = self._recorded[self._calls]
        self._calls += 1
        assert engine == i, "the shape's forwards differ from training's"
        if i != self.target and self.engines[i].global_steps != steps:
            return output
        return self.engines[i](*args, **kwargs)

    def backward(self, loss, i=0, retain_graph=False, scale_wrt_gas=True):
        self._add(loss, scale_wrt_gas)

    def direct(self, tensor, grad=None, retain_graph=False):
        self._add(tensor if grad is None else (tensor.float() * grad.float()).sum(), True)

    def scaled(self, loss, i=0, retain_graph=False):
        self._add(loss, True)

    def zero_grad(self):
        self.total = None


class RecordingDriver:
    """Wraps the contract's engine driver: records each micro-step's forwards and whether it discarded the window."""

    def __init__(self, driver):
        self._driver = driver
        self.zeroed = False
        self.forwards = []

    def __getattr__(self, name):
        return getattr(self._driver, name)

    def start_micro_step(self):
        self.zeroed = False
        self.forwards = []

    def fwd(self, i, *args, **kwargs):
        out = self._driver.fwd(i, *args, **kwargs)
        self.forwards.append((i, self._driver.engines[i].global_steps, out.detach()))
        return out

    def zero_grad(self):
        self.zeroed = True
        self._driver.zero_grad()


def shape_loss_fn(shape, engines, rank):
    """``loss_fn(engine, (t, batch, forwards))``: micro-step ``t`` of ``shape`` recomputed for ``engine``."""

    def loss_fn(engine, item):
        t, batch, forwards = item
        driver = LossDriver(engines, engines.index(engine), forwards)
        shape.fn(driver, batch, t, rank)
        return driver.total

    return loss_fn


def snapshot(engine):
    """Everything the audit must leave unchanged: gradient, fp32 values, the model's parameters, the generators."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
    named = list(engine.module.named_parameters())
    return {
        "grad": [safe_get_full_grad(p) for _, p in named],
        "fp32": [safe_get_full_fp32_param(p) for _, p in named],
        "model": [p.detach().clone() for _, p in named],
        "shards": [p.ds_tensor.detach().clone() for _, p in named if hasattr(p, "ds_tensor")],
        "rng": torch.get_rng_state(),
    }


def assert_same(before, after, what):
    for key in before:
        a, b = before[key], after[key]
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f"{what}: the audit changed {key}"
            continue
        assert len(a) == len(b), f"{what}: {key}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert (x is None) == (y is None), f"{what}: {key}[{i}]"
            if x is not None:
                assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: the audit changed {key}[{i}]"


def report_tuple(report):
    return (report.ok, report.max_rel_error, report.rel_errors, report.dominant_groups, report.tolerance,
            report.skipped)


def run_audit_cell(cell):
    """Worker body: train ``cell`` of the contract matrix, auditing every engine at every boundary."""
    import deepspeed
    import deepspeed.comm as dist
    from tests.unit.contract.drivers import EngineDriver, protocol_context
    from tests.unit.contract.models import make_batch
    from tests.unit.contract.runner import make_config
    from tests.unit.contract.shapes import SHAPES, build_model

    shape = SHAPES[cell["shape"]]
    rank = dist.get_rank()
    gas = [cell["gas"] * m for m in shape.gas_mult]
    torch.manual_seed(0)
    models = [build_model(kind) for kind in shape.models]
    engines = [deepspeed.initialize(model=m, config=make_config(cell, g, shape))[0] for m, g in zip(models, gas)]
    driver = RecordingDriver(EngineDriver(engines, fp16=cell["dtype"] == "fp16"))
    loss_fn = shape_loss_fn(shape, engines, rank)
    windows = [[] for _ in engines]  # this rank's micro-steps of each engine's window
    reports = []
    try:
        for t in range(cell.get("steps", 2) * math.lcm(*gas)):
            boundary = [(t + 1) % g == 0 for g in gas]
            if shape.protocol == "accelerate":
                for e, b in zip(engines, boundary):
                    e.set_gradient_accumulation_boundary(b)
            batch = make_batch(rank, t)
            driver.start_micro_step()
            with protocol_context(shape.protocol, engines, boundary[0]):
                shape.fn(driver, batch, t, rank)
            for window in windows:
                if driver.zeroed:
                    window.clear()
                window.append((t, batch, driver.forwards))
            # Every engine is audited before any steps: the loss of one may run the others' forwards.
            for i, engine in enumerate(engines):
                if boundary[i]:
                    engine._stage.finish_window()
                    before = snapshot(engine)
                    report = engine.audit_gradients(loss_fn, windows[i], **cell.get("audit", {}))
                    assert_same(before, snapshot(engine), f"rank {rank} step {t} engine {i}")
                    reports.append(report_tuple(report))
                    windows[i] = []
            for i, engine in enumerate(engines):
                if shape.protocol in ("accelerate", "unmanaged") and not boundary[i]:
                    continue
                engine.step()
    finally:
        for engine in engines:
            engine.destroy()
    return reports
