# SPDX-License-Identifier: Apache-2.0
"""Experts of expert-parallel size 2 on ZeRO-3 with ``offload_optimizer.device: cpu``: training equals plain torch.

Several steps of Adam with gradient clipping active (the clip threshold is below every step's norm), worlds 2 and
4 (experts sharded over expert-data-parallel groups of one and two ranks), fp32 on torch's host Adam (the whole
host step), fp32 with ``DS_NATIVE_CPU_ADAM=1`` and bf16 (the pipelined unit step), with ``super_offload``, a device
share (``ratio`` 0.5) and the optimizer state on disk (``device: nvme``) in one cell each. Each cell trains the
model of ``test_moe_contract`` twice, with the optimizer offloaded and without, and compares every rank's losses
and the fp32 masters of the dense parameters and of this rank's experts with a plain-torch run: fp32 cells with
the token-by-token reference holding every expert (tests/unit/moe/reference.py), bf16 cells with the layer at ep 1
in plain torch and bf16 (fp32 masters, cast back after each step), as ``test_moe_contract`` does. Parameters are
compared by their change over the run, so a step that did nothing fails. The runs with and without offload must
agree as closely as each agrees with the reference, and bitwise where both step on torch's kernels.
"""

import os
import shutil
import tempfile

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.moe.reference import reference_moe_output
from tests.unit.moe.test_moe_contract import (AUX, D, E, S, Net, _Expert, _dense_values, _expert_values,
                                              reference_layers)

T = 240
# eps near the clipped gradient's elements, so that Adam's update depends on the clipping coefficient
STEPS, LR, CLIP, EPS = 3, 0.02, 0.05, 1e-3


def _data(world, gas):
    """``[step][micro][rank]`` inputs."""
    g = torch.Generator().manual_seed(123)
    return [[[torch.randn(S, D, generator=g) for _ in range(world)] for _ in range(gas)] for _ in range(STEPS)]


def _named(model, experts):
    """``name -> parameter`` of a model's dense parameters and of the experts ``experts`` (global index ->
    expert module)."""
    named = {"inp." + n: p for n, p in model.inp.named_parameters()}
    named.update({"out." + n: p for n, p in model.out.named_parameters()})
    named["gate"] = model.moe.deepspeed_moe.gate.wg.weight
    for e, ex in experts.items():
        named.update({f"expert{e}." + n: p for n, p in ex.named_parameters()})
    return named


def _train(ep, k, gas, dtype_name, offload, offload_param=None, zero_init=False):
    """Train with the engine (``offload``: the ``offload_optimizer`` section or False, ``offload_param`` that
    section or None; ``zero_init``: the model built under ``deepspeed.zero.Init``); ``(losses of this rank and
    global norms, {name: fp32 master after the run})``."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    with deepspeed.zero.Init(enabled=bool(zero_init)):
        model = Net(ep, k)
    assert bool(zero_init) == hasattr(model.inp.weight, "ds_id")
    if zero_init == "constructed":
        _construct_experts(model, ep)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 40,
            "stage3_param_persistence_threshold": 0
        },
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": LR,
                "eps": EPS,
                "weight_decay": 0.0
            }
        }
    }
    if dtype_name == "bf16":
        config["bf16"] = {"enabled": True}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = offload
    if offload_param:
        config["zero_optimization"]["offload_param"] = offload_param
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    stage = engine._stage
    assert (stage.fetch is not None) == bool(offload_param)
    assert (stage.host_step is not None) == bool(offload)
    assert (stage.param_tier is not None) == bool(offload_param and offload_param["device"] == "nvme")
    if offload:  # the unit step where the host step is pipelined (bf16, or fp32 on the native op)
        assert (stage.unit_step is not None) == (dtype_name == "bf16" or os.environ.get("DS_NATIVE_CPU_ADAM") == "1")
        assert (stage.speculative is not None) == bool(offload.get("super_offload"))
        assert (stage.host_step.share is not None) == (offload.get("ratio", 1.0) < 1.0)
        assert (stage.host_step.swap is not None) == (offload["device"] == "nvme")
    for name, p in model.named_parameters():  # experts sharded over their expert-data-parallel group
        over = world // ep if ".deepspeed_experts." in name else world
        assert p.ds_shard_numel == -(-p.ds_numel // over), (name, p.ds_shard_numel, over)
    losses, norms = [], []
    for xs in _data(world, gas):
        for micro in range(gas):
            loss = engine(xs[micro][rank].to(dtype))
            losses.append(float(loss))
            engine.backward(loss)
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
        assert norms[-1] > CLIP * 1.5  # clipping is active
    experts = {
        e: model.moe.deepspeed_moe.experts.deepspeed_experts[i]
        for i, e in enumerate(model.moe.global_expert_indices)
    }
    masters = {n: safe_get_full_fp32_param(p).clone() for n, p in _named(model, experts).items()}
    engine.destroy()
    return losses + norms, masters


def _construct_experts(model, ep):
    """Local experts built by their constructor under zero.Init, then marked: partitioned over every rank with one
    value (rank 0's, as zero.Init makes it), local expert ``l`` of every expert-parallel rank starting from
    ``_expert_values(l)``, until ``initialize`` shards them over their expert-data-parallel group."""
    import deepspeed
    from deepspeed.moe.utils import mark_expert_param
    experts = model.moe.deepspeed_moe.experts
    with deepspeed.zero.Init():
        experts.deepspeed_experts = torch.nn.ModuleList([_Expert() for _ in range(E // ep)])
    params = list(experts.deepspeed_experts.parameters())
    assert all(hasattr(p, "ds_id") for p in params)
    with torch.no_grad(), deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        for local, expert in enumerate(experts.deepspeed_experts):
            for p, v in zip(expert.parameters(), _expert_values(local)):
                p.copy_(v)
    for p in params:
        mark_expert_param(p, model.moe.expert_group_name)


def _reference_fp32(world, gas, k, source=lambda e: e):
    """Plain torch, every expert on this rank, routing token by token (expert ``e`` starting from
    ``_expert_values(source(e))``); ``(losses of every rank, masters)``."""
    named, loss_of = reference_model(k, source)
    return _reference_steps(named, loss_of, world, gas, lambda x: x)


def reference_model(k, source=lambda e: e):
    """The model of ``test_moe_contract`` in plain torch with every expert on this rank, routing token by token
    (expert ``e`` starting from ``_expert_values(source(e))``): ``({name: parameter}, loss_of(x))`` (experts named
    ``expert<global index>.``)."""
    inp, out, gate, experts = reference_layers(source)
    named = {"inp." + n: p for n, p in inp.named_parameters()}
    named.update({"out." + n: p for n, p in out.named_parameters()})
    named["gate"] = gate
    for e, ex in enumerate(experts):
        named.update({f"expert{e}." + n: p for n, p in ex.named_parameters()})

    def loss_of(x):
        h = inp(x)
        m, l_aux, _ = reference_moe_output(h, gate, experts, k, 1.0, 1)
        return out(h + m).float().square().mean() + AUX * l_aux

    return named, loss_of


def _reference_bf16(world, gas, k):
    """The layer at ep 1 in plain torch and bf16, stepped on fp32 masters; ``(losses of every rank, masters)``."""
    model = Net(1, k).to(torch.bfloat16)
    experts = dict(enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts))
    return _reference_steps(_named(model, experts), model, world, gas, lambda x: x.to(torch.bfloat16))


def _reference_steps(named, loss_of, world, gas, cast):
    """Adam on fp32 masters of ``named`` (the parameters, of any dtype, get the masters' values after each step),
    the window gradient ``1/(W GAS) sum d loss / dp`` clipped by ``min(1, CLIP / (norm + 1e-6))``; every rank's
    losses are followed by the steps' global norms."""
    params = list(named.values())
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    opt = torch.optim.Adam(masters, lr=LR, eps=EPS, weight_decay=0.0)
    losses, norms = [[] for _ in range(world)], []
    for xs in _data(world, gas):
        grads = [torch.zeros(m.shape) for m in masters]
        for micro in range(gas):
            for r in range(world):
                loss = loss_of(cast(xs[micro][r]))
                losses[r].append(float(loss))
                got = torch.autograd.grad(loss, params, allow_unused=True)
                for acc, g in zip(grads, got):
                    if g is not None:
                        acc += g.float() / (world * gas)
        norm = torch.cat([g.reshape(-1) for g in grads]).norm()
        norms.append(float(norm))
        coef = torch.clamp(CLIP / (norm + 1e-6), max=1.0)
        for m, g in zip(masters, grads):
            m.grad = g * coef
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m.to(p.dtype))
    return [r + norms for r in losses], {n: m.detach() for n, m in zip(named, masters)}


def _compare(what, got, want, initial, tol):
    """Mismatches of ``got`` against ``want``: losses and global norms relative to their size, masters by their
    change from ``initial`` (relative to the reference change, at least 5% of the whole change)."""
    bad = []
    losses, masters = got
    ref_losses, ref_masters = want
    bad += [
        f"{what} loss or norm {i}: {a} vs {b}" for i, (a, b) in enumerate(zip(losses, ref_losses))
        if abs(a - b) > tol * abs(b)
    ]
    total = float(torch.cat([(ref_masters[n] - initial[n]).reshape(-1) for n in masters]).norm())
    assert total > 0
    for n, value in masters.items():
        change, ref_change = value - initial[n], ref_masters[n] - initial[n]
        err = float((change - ref_change).norm())
        if not err <= tol * max(float(ref_change.norm()), 0.05 * total):
            bad.append(f"{what} {n}: |diff| {err:.3g} |ref change| {float(ref_change.norm()):.3g}")
    return bad


def _initial(dtype, source=lambda e: e):
    values = _dense_values()
    out = {
        "inp.weight": values["inp"][0],
        "inp.bias": values["inp"][1],
        "gate": values["gate"],
        "out.weight": values["out"][0],
        "out.bias": values["out"][1]
    }
    for e in range(E):
        for n, v in zip(["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"], _expert_values(source(e))):
            out[f"expert{e}." + n] = v
    return {n: v.to(dtype).float() for n, v in out.items()}


def _cell(ep, k, gas, dtype_name, native, offload, offload_param=None, zero_init=False, baselines=None):
    """The mismatches of one cell; ``baselines`` (a dict) keeps the run without offload and the reference of
    each ``(ep, k, gas, dtype)`` for later cells of the same."""
    from deepspeed.utils import groups
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if native:
        os.environ["DS_NATIVE_CPU_ADAM"] = "1"
    on_disk = [s for s in (offload, offload_param) if s and s["device"] == "nvme"]
    disk = tempfile.mkdtemp() if on_disk else None
    try:
        offloaded = _train(ep,
                           k,
                           gas,
                           dtype_name,
                           dict(offload, nvme_path=disk) if offload and offload in on_disk else offload,
                           dict(offload_param, nvme_path=disk) if offload_param in on_disk else offload_param,
                           zero_init=zero_init)
    finally:
        os.environ.pop("DS_NATIVE_CPU_ADAM", None)
        if disk:
            shutil.rmtree(disk, ignore_errors=True)
    key = (ep, k, gas, dtype_name)
    baselines = {} if baselines is None else baselines
    if key not in baselines:
        plain = _train(ep, k, gas, dtype_name, False)
        reference = _reference_fp32(world, gas, k) if dtype_name == "fp32" else _reference_bf16(world, gas, k)
        baselines[key] = plain, reference
    plain, (ref_losses, ref_masters) = baselines[key]
    tol = 1e-5 if dtype_name == "fp32" else 2e-2
    groups.reset_mesh()
    if zero_init == "constructed":  # every expert-parallel rank's local expert l started from the same values
        assert dtype_name == "fp32"
        per = E // ep
        ref_losses, ref_masters = _reference_fp32(world, gas, k, source=lambda e: e % per)
        want = (ref_losses[rank], {n: ref_masters[n] for n in offloaded[1]})
        return _compare("zero.Init", offloaded, want, _initial(torch.float32, source=lambda e: e % per), tol)
    want = (ref_losses[rank], {n: ref_masters[n] for n in offloaded[1]})
    initial = _initial(torch.bfloat16 if dtype_name == "bf16" else torch.float32)
    bad = _compare("offload", offloaded, want, initial, tol)
    bad += _compare("no offload", plain, want, initial, tol)
    bad += _compare("offload vs no offload", offloaded, plain, initial, tol)
    if dtype_name == "fp32" and not native:  # both step on torch's Adam kernels: the same bits
        bad += [f"loss or norm {i} not bitwise" for i, (a, b) in enumerate(zip(offloaded[0], plain[0])) if a != b]
        bad += [f"{n} not bitwise" for n in plain[1] if not torch.equal(offloaded[1][n], plain[1][n])]
    return bad


def _cells(cells):
    baselines = {}
    return [(cell, bad[:4]) for cell in cells for bad in [_cell(*cell, baselines=baselines)] if bad]


CPU, NVME = {"device": "cpu"}, {"device": "nvme"}


# (ep, k, gas, dtype, native host Adam for fp32, offload_optimizer): the whole host step on torch's Adam (bitwise
# with the run without offload), the unit step (bf16, fp32 on the native op), super_offload's speculative step,
# a device share (ratio < 1) and the optimizer state on disk (nvme)
@pytest.mark.parametrize("world, cells", [(2, [(2, 2, 2, "fp32", False, CPU),
                                               (2, 1, 1, "bf16", False, dict(CPU, super_offload=True))]),
                                          (4, [(2, 1, 1, "fp32", True, dict(CPU, ratio=0.5)),
                                               (2, 2, 2, "bf16", False, NVME)])])
def test_stage3_experts_offload_optimizer_trains_like_torch(world, cells):
    assert run_distributed(_cells, world, args=(cells, ), timeout=T) == [[]] * world


# (ep, k, gas, dtype, native, offload_optimizer, offload_param, zero.Init) on world 4: the experts are sharded over
# groups of two ranks and their 16-bit shards live on the host, written by the whole host step (bitwise with the run
# without offload), or on disk (nvme) with the masters beside the device (bitwise too: both step on torch's Adam);
# the model built under zero.Init: the MoE layer's expert copies whole until initialize shards them over their
# group; expert modules built by their constructor under zero.Init (partitioned over every rank, one value), which
# initialize re-shards over their group (with offload_param)
def test_stage3_experts_offload_param_and_zero_init_train_like_torch():
    cells = [(2, 2, 2, "fp32", False, CPU, CPU), (2, 2, 2, "fp32", False, False, NVME),
             (2, 2, 2, "fp32", False, False, None, True), (2, 2, 2, "fp32", False, False, CPU, "constructed")]
    assert run_distributed(_cells, 4, args=(cells, ), timeout=T) == [[]] * 4
