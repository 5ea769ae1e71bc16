# SPDX-License-Identifier: Apache-2.0
"""Run one cell of the contract matrix on every rank and compare with the reference.

Each rank trains the engines for ``steps`` optimizer steps of every engine; the
reference (plain torch, every rank's data) runs alongside. At each engine's
accumulation boundary, before ``step()``, every gradient an engine reports
(``safe_get_full_grad``) must equal the reference gradient; after ``step()`` every
fp32 parameter must equal the reference optimizer's (SGD with momentum, gradient
clipping at 1.0, both computed in plain torch).

``cell["device"]`` (optional, default ``"cpu"``) is where the reference models and the
batches live: ``"cuda"`` means this rank's GPU (``LOCAL_RANK``), the device the engines
move their models to. Gradients and parameters an engine reports are compared on the
reference's device (an offloaded optimizer keeps its fp32 masters on the CPU).
"""

import copy
import math

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GRAD_TOL = {"fp32": dict(rtol=1e-5, atol=1e-6), "bf16": dict(rtol=1e-2, atol=1e-4), "fp16": dict(rtol=1e-2, atol=1e-4)}
PARAM_TOL = {
    "fp32": dict(rtol=1e-5, atol=1e-6),
    "bf16": dict(rtol=1e-3, atol=1e-4),
    "fp16": dict(rtol=1e-3, atol=1e-4)
}
LR, MOMENTUM, CLIP = 0.1, 0.9, 1.0
LOSS_SCALE_POWER = 8


def make_config(cell, gas, shape):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "steps_per_print": float("inf"),
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": LR,
                "momentum": MOMENTUM
            }
        },
        "zero_optimization": {
            "stage": cell["stage"],
            "reduce_bucket_size": cell.get("bucket", 64)
        },
    }
    cfg.update(cell.get("zero_extra_top", {}))
    cfg["zero_optimization"].update(cell.get("zero_extra", {}))
    if cell["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif cell["dtype"] == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": LOSS_SCALE_POWER}
    cfg.update(shape.config)
    return cfg


class Reference:
    """Plain-torch training of the same models: the expected gradients and parameters."""

    def __init__(self, models, dtype, gas, world_size, loss_scale, device=None, divisor=None, accum_dtype=None):
        self.models = [copy.deepcopy(m).to(device=device, dtype=dtype) for m in models]
        self.gas = gas
        self.world_size = world_size
        self.divisor = world_size if divisor is None else divisor  # 1 for gradient_allreduce_op "sum"
        self.loss_scale = loss_scale
        self.masters = [{n: p.detach().float().clone() for n, p in m.named_parameters()} for m in self.models]
        self.optimizers = []
        for masters in self.masters:
            for t in masters.values():
                t.requires_grad_(True)
            self.optimizers.append(torch.optim.SGD(list(masters.values()), lr=LR, momentum=MOMENTUM, foreach=False))
        # The window's gradient, accumulated in the engine's accumulation dtype: fp32 by default; with
        # bf16 accumulation each rank's contribution of each micro-step is rounded and added in bf16.
        self.accum_dtype = accum_dtype or torch.float32
        self.accum = [{
            n: torch.zeros_like(p, dtype=self.accum_dtype)
            for n, p in masters.items()
        } for masters in self.masters]

    def micro_step(self, shape, t, batch=None):
        """Run micro-step ``t`` of ``shape`` for every rank's data and add it to the window."""
        from tests.unit.contract.drivers import ReferenceDriver
        from tests.unit.contract.models import make_batch
        batch = batch or make_batch
        drivers = []
        for r in range(self.world_size):
            drv = ReferenceDriver(self.models, self.gas, self.divisor, self.loss_scale)
            shape.fn(drv, batch(r, t), t, r)
            drivers.append(drv)
        if any(d.zeroed for d in drivers):
            for grads in self.accum:
                for g in grads.values():
                    g.zero_()
        for drv in drivers:
            for grads, local in zip(self.accum, drv.local):
                for name, g in local.items():
                    grads[name] += g.to(self.accum_dtype)

    def step(self, i):
        grads = self.accum[i]
        norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1).float() for g in grads.values()]))
        coef = min(1.0, CLIP / (float(norm) + 1e-6))
        with torch.no_grad():
            for name, master in self.masters[i].items():
                master.grad = grads[name].float() * coef
            self.optimizers[i].step()
            for name, param in self.models[i].named_parameters():
                param.copy_(self.masters[i][name])
        for g in grads.values():
            g.zero_()
        return float(norm)


def _compare(what, actual, expected, tol):
    torch.testing.assert_close(actual.float().to(expected.device),
                               expected.float(),
                               **tol,
                               msg=lambda m: f"{what}: {m}")


def cell_device(cell):
    """The device of the reference models and the batches: the CPU, or this rank's GPU for ``"cuda"``."""
    import deepspeed.comm as dist
    kind = cell.get("device", "cpu")
    return torch.device("cuda", dist.get_local_rank()) if kind == "cuda" else torch.device(kind)


def _check_released(engines):
    """ZeRO-3: after every backward, every non-persistent parameter is released again."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    for engine in engines:
        for name, param in engine.module.named_parameters():
            if not param.ds_persist:
                assert param.ds_status == ZeroParamStatus.NOT_AVAILABLE and param.data.numel() == 0, \
                    f"{name} is still gathered after backward"


def _named(engine):
    """The engine's parameters by the plain model's names (``torch.compile`` wraps the model as ``_orig_mod``)."""
    prefix = "_orig_mod."
    return [(n[len(prefix):] if n.startswith(prefix) else n, p) for n, p in engine.module.named_parameters()]


def run_cell(cell):
    """Worker body: train, compare at every boundary, return the number of checked steps."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
    from tests.unit.contract.drivers import EngineDriver, protocol_context
    from tests.unit.contract.models import make_batch
    from tests.unit.contract.shapes import SHAPES, build_model

    shape = SHAPES[cell["shape"]]
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[cell["dtype"]]
    gas = [cell["gas"] * m for m in shape.gas_mult]
    torch.manual_seed(0)
    models = [build_model(kind) for kind in shape.models]
    loss_scale = float(2**LOSS_SCALE_POWER) if cell["dtype"] == "fp16" else 1.0
    device = cell_device(cell)

    def batch(r, t):
        return tuple(x.to(device) for x in make_batch(r, t))

    top = cell.get("zero_extra_top", {})
    summed = top.get("gradient_allreduce_op") == "sum"
    accum_dtype = DTYPES.get(top.get("data_types", {}).get("grad_accum_dtype"))
    ref = Reference(models,
                    dtype,
                    gas,
                    world,
                    loss_scale,
                    device,
                    divisor=1 if summed else world,
                    accum_dtype=accum_dtype)
    if cell.get("zero_init"):  # the engines' models are built partitioned, inside zero.Init (the same initial values)
        torch.manual_seed(0)
        with deepspeed.zero.Init():
            models = [build_model(kind) for kind in shape.models]
        assert all(hasattr(p, "ds_id") for m in models for p in m.parameters()), "zero.Init did not partition"
    compiled = cell.get("compile")  # None, "torch" (torch.compile before initialize) or "engine" (engine.compile)
    if compiled == "torch":
        models = [torch.compile(m, backend=cell.get("backend", "inductor")) for m in models]
    engines = [deepspeed.initialize(model=m, config=make_config(cell, g, shape))[0] for m, g in zip(models, gas)]
    if compiled == "engine":
        for engine in engines:
            engine.compile(backend=cell.get("backend", "inductor"))
            deepcompile = bool(top.get("compile", {}).get("deepcompile"))
            assert engine.is_deepcompile_enabled() == deepcompile and engine.is_deepcompile_active() == deepcompile
    drv = EngineDriver(engines, fp16=cell["dtype"] == "fp16")
    period = math.lcm(*gas)
    checked = 0
    try:
        for t in range(cell.get("steps", 2) * period):
            boundary = [(t + 1) % g == 0 for g in gas]
            if shape.protocol == "accelerate":
                for e, b in zip(engines, boundary):
                    e.set_gradient_accumulation_boundary(b)
            with protocol_context(shape.protocol, engines, boundary[0], coalesce=cell.get("coalesce", False)):
                shape.fn(drv, batch(rank, t), t, rank)
            ref.micro_step(shape, t, batch)
            if cell["stage"] == 3:
                _check_released(engines)
            for i, engine in enumerate(engines):
                # Unmanaged accumulation reduces inside step(): there the step's norm and
                # parameters (which determine the gradient exactly under SGD) are checked.
                if boundary[i] and shape.protocol != "unmanaged":
                    for name, param in _named(engine):
                        _compare(f"rank {rank} step {t} engine {i} grad {name}", safe_get_full_grad(param),
                                 ref.accum[i][name], cell.get("grad_tol", GRAD_TOL[cell["dtype"]]))
                if shape.protocol in ("accelerate", "unmanaged") and not boundary[i]:
                    continue
                engine.step()
                if boundary[i]:
                    assert engine.was_step_applied(), f"engine {i} skipped step {t}"
                    ref_norm = ref.step(i)
                    got_norm = engine.get_global_grad_norm()
                    assert abs(got_norm - ref_norm) <= 1e-2 * ref_norm + 1e-5, (got_norm, ref_norm)
                    for name, param in _named(engine):
                        _compare(f"rank {rank} step {t} engine {i} param {name}", safe_get_full_fp32_param(param),
                                 ref.masters[i][name].detach(), cell.get("param_tol", PARAM_TOL[cell["dtype"]]))
                    checked += 1
        for engine in engines:
            assert engine.get_loss_scale() == loss_scale
    finally:
        for engine in engines:
            engine.destroy()
    return checked
