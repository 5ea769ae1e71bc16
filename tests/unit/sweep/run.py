# SPDX-License-Identifier: Apache-2.0
"""Worker bodies of the random sweep: one case trained through the engine, checked on the way.

:func:`run_against_torch` (every case without ZenFlow) uses the contract harness: the plain-torch
:class:`~tests.unit.contract.runner.Reference` (SGD with momentum over every rank's data, the contract's
formula for the gradient) run alongside; at every boundary each reported gradient (``safe_get_full_grad``) and,
after the step, the global norm and each fp32 parameter (``safe_get_full_fp32_param``) must equal it.

:func:`run_zenflow` (ZenFlow cases) trains with AdamW and returns, per ZenFlow step, the parameters and, per selection,
the selected columns; it checks the plain-torch model of the algorithm (``tests/unit/zenflow/reference.py``) on the
way. The test compares a world-``W`` run with the world-1 run over the same global batches.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

MICRO = 2
LR, MOMENTUM = 0.1, 0.9
ADAM_LR, ADAM_EPS = 1e-2, 1e-4  # eps: see tests/unit/zenflow/test_zenflow_worlds.py


def build_mlp(widths):
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def make_batch(widths, rank, micro, size=MICRO, dtype=torch.float32):
    """One rank's micro-batch of global micro-step ``micro`` (every rank can rebuild every other rank's); the
    inputs in the model's dtype, as a user passes them."""
    gen = torch.Generator().manual_seed(7919 * rank + 104729 * micro + 11)
    return torch.randn(size, widths[0], generator=gen).to(dtype), torch.randn(size, widths[-1], generator=gen)


def mse(out, target):
    return F.mse_loss(out.float(), target.float())


# The micro-step of each call style, written once against the contract's drivers.
def call_engine(d, batch, t, rank):
    x, y = batch
    d.backward(mse(d.fwd(0, x), y))


def call_direct(d, batch, t, rank):
    x, y = batch
    d.direct(mse(d.fwd(0, x), y))


def call_two_losses(d, batch, t, rank):
    x, y = batch
    out = d.fwd(0, x)
    d.backward(mse(out, y), retain_graph=True)
    d.backward(out.float().pow(2).mean() * 0.5)


CALLS = {"engine": call_engine, "direct": call_direct, "two_losses": call_two_losses}


def ds_config(case, optimizer, micro=MICRO):
    zero = {"stage": case["stage"], "reduce_bucket_size": case["bucket"], "overlap_comm": case["overlap"]}
    if case["offload"]:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        if case["offload_param"]:
            zero["offload_param"] = {"device": "cpu"}
    if case["units"] is not None:
        zero["stage3_prefetch_bucket_size"], zero["stage3_param_persistence_threshold"] = case["units"]
    if case["zenflow"]:
        zero["zenflow"] = case["zenflow"]
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": case["gas"],
        "gradient_clipping": case["clip"],
        "steps_per_print": float("inf"),
        "optimizer": optimizer,
        "zero_optimization": zero,
    }
    if case["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif case["dtype"] == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _clipped_reference_step(ref, clip):
    """The contract reference's step with the case's clipping (0: none); returns the unclipped norm."""
    grads = ref.accum[0]
    norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1).float() for g in grads.values()])))
    coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    with torch.no_grad():
        for name, master in ref.masters[0].items():
            master.grad = grads[name].float() * coef
        ref.optimizers[0].step()
        for name, param in ref.models[0].named_parameters():
            param.copy_(ref.masters[0][name])
    for g in grads.values():
        g.zero_()
    return norm


def _named(engine):
    prefix = "_orig_mod."
    return [(n[len(prefix):] if n.startswith(prefix) else n, p) for n, p in engine.module.named_parameters()]


def run_against_torch(case):
    """Train ``case`` (no ZenFlow) and compare with plain torch at every boundary; returns the steps checked."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
    from tests.unit.contract.drivers import EngineDriver
    from tests.unit.contract.runner import DTYPES, GRAD_TOL, PARAM_TOL, Reference, _compare
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == case["world"], (world, case["world"])
    dtype = DTYPES[case["dtype"]]
    gas, widths = case["gas"], case["widths"]
    loss_scale = 256.0 if case["dtype"] == "fp16" else 1.0
    torch.manual_seed(0)
    model = build_mlp(widths)
    ref = Reference([model], dtype, [gas], world, loss_scale)
    if case["compile"] == "torch":
        model = torch.compile(model, backend="eager")
    optimizer = {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}}
    engine = deepspeed.initialize(model=model, config=ds_config(case, optimizer))[0]
    drv = EngineDriver([engine], fp16=case["dtype"] == "fp16")
    call = CALLS[case["call"]]
    grad_tol, param_tol = GRAD_TOL[case["dtype"]], PARAM_TOL[case["dtype"]]

    class Step:  # the contract reference's shape interface: ``fn(driver, batch, t, rank)``
        fn = staticmethod(call)

    checked = 0
    try:
        for t in range(case["steps"] * gas):
            call(drv, make_batch(widths, rank, t, dtype=dtype), t, rank)
            ref.micro_step(Step, t, lambda r, m: make_batch(widths, r, m, dtype=dtype))
            if (t + 1) % gas:
                engine.step()
                continue
            for name, param in _named(engine):
                _compare(f"rank {rank} micro-step {t} grad {name}", safe_get_full_grad(param), ref.accum[0][name],
                         grad_tol)
            engine.step()
            assert engine.was_step_applied(), f"step {t} skipped"
            want = _clipped_reference_step(ref, case["clip"])
            got = engine.get_global_grad_norm()
            assert abs(got - want) <= 1e-2 * want + 1e-5, f"global norm {got} != {want}"
            for name, param in _named(engine):
                _compare(f"rank {rank} micro-step {t} param {name}", safe_get_full_fp32_param(param),
                         ref.masters[0][name].detach(), param_tol)
            checked += 1
    finally:
        engine.destroy()
    return checked


def gathered(engine, stage):
    """The model's parameters as the next forward computes with them (ZeRO-3: gathered)."""
    import deepspeed
    if stage != 3:
        return dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def run_zenflow(case, data_world):
    """Train the ZenFlow ``case`` at this pool's world size on ``data_world`` ranks' worth of data (each rank takes
    its share of every global micro-batch); returns ``dict(params=[per ZenFlow step], selections=[(step, columns)])``
    and checks the plain-torch model of the algorithm after every step."""
    import deepspeed
    import deepspeed.comm as dist
    from tests.unit.zenflow.reference import ZenFlowReference
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = data_world // world
    widths, zf = case["widths"], case["zenflow"]
    torch.manual_seed(0)
    model = build_mlp(widths)
    ref = ZenFlowReference(dict(model.named_parameters()),
                           lr=ADAM_LR,
                           eps=ADAM_EPS,
                           clip=case["clip"],
                           topk=zf["topk_ratio"],
                           update_every=zf["update_interval"],
                           select_every=zf["select_interval"],
                           overlap=zf["overlap_step"])
    optimizer = {"type": "AdamW", "params": {"lr": ADAM_LR, "eps": ADAM_EPS, "weight_decay": 0.0}}
    engine = deepspeed.initialize(model=copy.deepcopy(model), config=ds_config(case, optimizer, MICRO * per_rank))[0]
    zenflow = engine._stage.zenflow
    names = {p: n for n, p in engine.module.named_parameters()}
    params, selections = [], []
    try:
        for at in range(case["steps"]):  # every micro-batch is a ZenFlow step (the host window replaces accumulation)
            micro = [make_batch(widths, r, at) for r in range(data_world)]
            probe = copy.deepcopy(model)
            with torch.no_grad():
                for n, p in probe.named_parameters():
                    p.copy_(ref.Q[n])
            for x, y in micro:
                (mse(probe(x), y) / data_world).backward()
            selected_before = zenflow.selected_at
            mine = micro[rank * per_rank:(rank + 1) * per_rank]
            engine.backward(mse(engine(torch.cat([b[0] for b in mine])), torch.cat([b[1] for b in mine])))
            engine.step()
            ref.step({n: p.grad for n, p in probe.named_parameters()})
            if zenflow.selected_at != selected_before:
                cols = {names[p]: c.tolist() for p, c in zenflow.selection.selected_columns().items()}
                assert cols == {n: c.tolist() for n, c in ref.cols.items()}, f"step {at}: {cols} != {ref.cols}"
                selections.append((at, cols))
            values = {n: p.detach().clone() for n, p in gathered(engine, case["stage"]).items()}
            for n, v in values.items():
                torch.testing.assert_close(v, ref.Q[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"step {at} {n}: {m}")
            params.append(values)
    finally:
        engine.destroy()
    return dict(params=params, selections=selections)
