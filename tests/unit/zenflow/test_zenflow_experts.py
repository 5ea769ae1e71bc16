# SPDX-License-Identifier: Apache-2.0
"""ZenFlow with expert parameters: training equals the plain-torch ZenFlow reference of the unsharded model.

Expert parameters are partitioned over their expert-data-parallel group and differ by expert-parallel rank, so
ZenFlow selects an expert's columns from its column norms summed over that group (``selection.py``). Each cell
trains with ZenFlow (a small ``topk_ratio``, windows of 2 steps, a selection every 4, clipping active on every
step) and, after every step, compares on every rank the full values of the model's parameters (experts by global
index) and the fp32 masters with ``tests/unit/zenflow/reference.py`` stepped on the mean gradient over the global
batch of a plain-torch model holding every expert:

* the ``deepspeed.moe`` layer of ``test_moe_contract`` (tests/unit/moe/reference.py's token-by-token routing) at
  ep 2 on worlds 2 and 4 (expert-data-parallel groups of one and two ranks), ZeRO 2 (the window on the device,
  after a warm-up round; with ``zenflow.offload``: on the host, the "auto" window) and ZeRO 3 (the host window,
  ``overlap_step``, ``zenflow.offload``);
* AutoEP on a tiny Mixtral (fused ``(E, 2F, H)`` expert weights, each expert selected on its own) at ep 2 on
  world 2, ZeRO 3 (two experts per rank) and ZeRO 1 (one), against the unsharded Hugging Face model (its fused
  weights split per expert in the reference);
* a checkpoint saved in the middle of a window and loaded into a fresh engine at the same ep continues exactly.
"""

import os
import shutil
import tempfile

import pytest
import torch

from tests.unit.common import run_distributed

T = 240
LR, EPS, CLIP, STEPS = 0.02, 1e-3, 0.05, 6
ZENFLOW = dict(topk_ratio=0.2, update_interval=2, select_strategy="step", select_interval=4)


def _config(stage, zenflow, micro=1, zero_extra=None):
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": CLIP,
        "steps_per_print": float("inf"),
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 40,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {
                "device": "cpu"
            },
            "zenflow": zenflow
        },
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": LR,
                "eps": EPS,
                "weight_decay": 0.01
            }
        }
    }
    config["zero_optimization"].update(zero_extra or {})
    return config


def _reference(named, zenflow):
    from tests.unit.zenflow.reference import ZenFlowReference
    params = {n: p.detach() for n, p in named.items()}
    return ZenFlowReference.from_config(params, zenflow, lr=LR, eps=EPS, weight_decay=0.01, clip=CLIP)


def _mean_grads(named, values, losses):
    """The mean over ``losses`` (one closure per rank) of their gradients at ``values``."""
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(values[n])
    grads = {n: torch.zeros_like(p) for n, p in named.items()}
    for loss_of in losses:
        got = torch.autograd.grad(loss_of(), list(named.values()), allow_unused=True)
        for n, g in zip(named, got):
            if g is not None:
                grads[n] += g / len(losses)
    return grads


def _full_values(engine, named):
    """``name -> (model value, fp32 master)`` of the engine's parameters ``named`` (gathered on ZeRO-3)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    params = list(named.values())
    with deepspeed.zero.GatheredParameters(params):
        values = {n: p.detach().float().clone() for n, p in named.items()}
    return {n: (values[n], safe_get_full_fp32_param(p).clone()) for n, p in named.items()}


def _check(step, got, ref, want_of):
    bad = []
    masters = ref.fp32_values()
    for n, (value, master) in got.items():
        for what, have, want in (("value", value, want_of(ref.Q, n)), ("master", master, want_of(masters, n))):
            if not torch.allclose(have, want, rtol=1e-5, atol=1e-6):
                bad.append(f"step {step} {what} {n}: max diff {float((have - want).abs().max()):.3g}")
    return bad


# ------------------------------------------------------------------------------------------ the MoE layer
def _moe_data(world):
    g = torch.Generator().manual_seed(321)
    from tests.unit.moe.test_moe_contract import D, S
    return [[torch.randn(S, D, generator=g) for _ in range(world)] for _ in range(STEPS)]


def _moe_engine(stage, zenflow, ep=2, k=2, zero_extra=None):
    import deepspeed
    from tests.unit.moe.test_moe_contract import Net
    from tests.unit.moe.test_stage3_expert_offload import _named
    model = Net(ep, k)
    engine = deepspeed.initialize(model=model, config=_config(stage, zenflow, zero_extra=zero_extra))[0]
    experts = {
        e: model.moe.deepspeed_moe.experts.deepspeed_experts[i]
        for i, e in enumerate(model.moe.global_expert_indices)
    }
    return engine, _named(model, experts)


def _moe_cell(stage, zenflow, zero_extra=None):
    from deepspeed.utils import groups
    from tests.unit.moe.test_stage3_expert_offload import reference_model
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    engine, named = _moe_engine(stage, zenflow, zero_extra=zero_extra)
    ref_named, loss_of = reference_model(2)
    ref = _reference(ref_named, zenflow)
    zf = engine._stage.zenflow
    assert zf is not None and zf.on_device == (stage < 3 and not zenflow.get("offload", False))
    assert bool(engine._stage.config.offload_param) == ("offload_param" in (zero_extra or {}))
    assert len(zf.selection.groups) == 2, zf.selection.groups  # dense and the expert-data-parallel group
    bad, selections = [], 0
    try:
        for step, xs in enumerate(_moe_data(world)):
            grads = _mean_grads(ref_named, ref.Q, [lambda x=x: loss_of(x) for x in xs])
            before = zf.selected_at
            engine.backward(engine(xs[rank]))
            engine.step()
            ref.step(grads)
            selections += zf.selected_at != before
            norm = float(engine.get_global_grad_norm())
            assert norm > 1.5 * CLIP and abs(norm - ref.last_norm) <= 1e-5 * ref.last_norm, (norm, ref.last_norm)
            bad += _check(step, _full_values(engine, named), ref, lambda values, n: values[n])
    finally:
        engine.destroy()
        groups.reset_mesh()
    assert selections >= 2
    return bad[:4]


def _moe_cells(cells):
    return [(cell, bad) for cell in cells for bad in [_moe_cell(*cell)] if bad]


@pytest.mark.parametrize("world", [2, 4])
def test_moe_layer_zero2_zero3(world):
    """Expert-data-parallel groups of one rank (world 2: nothing to sum over) and of two (world 4)."""
    cells = [(2, dict(ZENFLOW, full_warm_up_rounds=1)),
             (2, dict(ZENFLOW, offload=True, update_interval="auto", auto_ratio=0.5)),
             (3, dict(ZENFLOW, overlap_step=True, offload=True))]
    if world == 4:  # the parameters offloaded too: the experts' 16-bit shards on the host, sized by their group
        cells.append((3, dict(ZENFLOW, offload=True), {"offload_param": {"device": "cpu"}}))
    assert run_distributed(_moe_cells, world, args=(cells, ), timeout=T) == [[]] * world


# ------------------------------------------------------------------------------------------------ AutoEP
def _is_routed_expert(name):
    return name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj")


def _split_experts(named):
    """A fused expert weight ``(E, ...)`` as ``E`` entries ``name#e`` (views)."""
    out = {}
    for n, p in named.items():
        if _is_routed_expert(n):
            out.update({f"{n}#{e}": p[e] for e in range(p.shape[0])})
        else:
            out[n] = p
    return out


def _autoep_cell(stage, n_experts):
    import deepspeed
    from deepspeed.utils import groups
    from tests.unit.moe.autoep_models import VOCAB, mixtral
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model, reference = mixtral(experts=n_experts), mixtral(experts=n_experts)
    config = _config(stage, ZENFLOW)
    config["expert_parallel"] = {"enabled": True, "autoep_size": 2}
    engine = deepspeed.initialize(model=model, config=config)[0]
    experts = next(m for m in model.modules() if type(m).__name__ == "GroupedExperts")
    first, local = experts.first_expert, experts.num_local_experts
    named = dict(model.named_parameters())
    ref_params = {n: p for n, p in reference.named_parameters()}
    ref = _reference(_split_experts({n: p.detach() for n, p in ref_params.items()}), ZENFLOW)
    g = torch.Generator().manual_seed(17)
    batches = [[torch.randint(0, VOCAB, (1, 8), generator=g) for _ in range(world)] for _ in range(STEPS)]

    def ref_loss(ids):
        return reference(input_ids=ids, labels=ids).loss

    def want_of(values, n):
        if not _is_routed_expert(n):
            return values[n]
        return torch.stack([values[f"{n}#{e}"] for e in range(first, first + local)])

    bad = []
    try:
        for step, ids in enumerate(batches):
            fused = {
                n: torch.stack([ref.Q[f"{n}#{e}"] for e in range(p.shape[0])]) if _is_routed_expert(n) else ref.Q[n]
                for n, p in ref_params.items()
            }
            grads = _split_experts(_mean_grads(ref_params, fused, [lambda i=i: ref_loss(i) for i in ids]))
            engine.backward(engine(input_ids=ids[rank], labels=ids[rank]).loss)
            engine.step()
            ref.step(grads)
            assert float(engine.get_global_grad_norm()) > 1.5 * CLIP
            bad += _check(step, _full_values(engine, named), ref, want_of)
        cols = engine._stage.zenflow.selection.selected_columns()
        fused_cols = [c for p, c in cols.items() if c.dim() == 2]
        assert fused_cols and all(c.shape[0] == local for c in fused_cols)  # one selection per expert
    finally:
        engine.destroy()
        groups.reset_mesh()
    return bad[:4]


def _autoep_cells(cells):
    return [(cell, bad) for cell in cells for bad in [_autoep_cell(*cell)] if bad]


def test_autoep_mixtral_world2():
    # ZeRO 3 with two experts per rank, ZeRO 1 with one (a fused weight of one expert)
    assert run_distributed(_autoep_cells, 2, args=([(3, 4), (1, 2)], ), timeout=T) == [[]] * 2


# ------------------------------------------------------------------------------------------- checkpoints
def _resume(stage, directory):
    """Train 6 steps saving after 3 (inside a window, an overlapped host step pending), then load into a fresh
    engine and take the last three steps again: the losses and values (model and fp32 masters) equal the continued
    run's, bitwise."""
    from deepspeed.utils import groups
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    zenflow = dict(ZENFLOW, select_interval=8, overlap_step=True)
    data = _moe_data(world)
    engine, named = _moe_engine(stage, zenflow)
    continued = []
    try:
        for step in range(6):
            if step == 3:
                zf = engine._stage.zenflow
                assert zf.window.count == 1 and zf.pending_apply, "the cut is not in the middle of a window"
                engine.save_checkpoint(directory, tag="mid")
            loss = engine(data[step][rank])
            if step >= 3:
                continued.append(float(loss))
            engine.backward(loss)
            engine.step()
        want = _full_values(engine, named)
    finally:
        engine.destroy()
        groups.reset_mesh()
    engine, named = _moe_engine(stage, zenflow)
    resumed = []
    try:
        engine.load_checkpoint(directory, tag="mid")
        for step in range(3, 6):
            loss = engine(data[step][rank])
            resumed.append(float(loss))
            engine.backward(loss)
            engine.step()
        got = _full_values(engine, named)
    finally:
        engine.destroy()
        groups.reset_mesh()
    bad = [f"loss {i}: {a} vs {b}" for i, (a, b) in enumerate(zip(resumed, continued)) if a != b]
    bad += [f"{n}" for n in want if not all(torch.equal(a, b) for a, b in zip(got[n], want[n]))]
    return bad


def _resume_cells(stages, directory):
    import deepspeed.comm as dist
    out = []
    for stage in stages:
        path = os.path.join(directory, f"stage{stage}")
        bad = _resume(stage, path)
        dist.barrier()
        if bad:
            out.append((stage, bad[:4]))
    return out


def test_checkpoint_resume_world2():
    directory = tempfile.mkdtemp()
    try:
        assert run_distributed(_resume_cells, 2, args=([2, 3], directory), timeout=T) == [[]] * 2
    finally:
        shutil.rmtree(directory, ignore_errors=True)
