# SPDX-License-Identifier: Apache-2.0
"""Expert checkpoints: upstream's per-expert files, an exact resume, and resharding to other expert-parallel sizes.

A run trains, saves, and trains on; a fresh engine (other initial weights) loads the checkpoint
and trains the same steps: its losses and every parameter (read with safe_get_full_fp32_param,
expert parameters on their own rank) must equal the first run's continuation exactly. The
MoE layer at ep 2 on ZeRO 0 and 2, AutoEP on a tiny Mixtral on ZeRO 1, both also on ZeRO-3 at ep 2 (the
MoE layer also with ``offload_optimizer.device: cpu``, the pipelined host step),
Adam (so that the optimizer state matters). Resharding: saved at ep 2 (world 4), a full load at ep 1
and at ep 4, and between ZeRO-3 and ZeRO 1, continues as the saving run did (losses and every expert,
wherever it now lives); saved on ZeRO-3 at ep 2 (world 4, experts sharded over two ranks) with the optimizer and
the parameters offloaded (``offload_param.device: cpu``), a load at ep 2 resumes exactly. A ZeRO-0 checkpoint (the
optimizer state of rank 0's experts only) loads at another size with the module only; a full load
raises on every rank.
"""

import os

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.moe.test_moe_contract import Net, _data

T = 240


def _engine(kind, stage, ep, seed):
    import deepspeed
    torch.manual_seed(seed)
    kind, offload, offparam = kind.split("+")[0], "+offload" in kind, kind.endswith("+offparam")
    if kind == "moe":
        model = Net(ep, 2)
        if seed != 0:  # other weights than the run that saved
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.3)
    else:
        from tests.unit.moe.test_autoep import _mixtral
        model = _mixtral()
        if seed != 0:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": stage
        },
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 0.01
            }
        }
    }
    if kind == "autoep":
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if offparam:
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    assert (getattr(engine._stage, "fetch", None) is not None) == offparam
    return engine, model


def _train(engine, kind, steps, offset):
    rank = torch.distributed.get_rank()
    kind = kind.split("+")[0]
    losses = []
    for step in range(steps):
        if kind == "moe":
            loss = engine(_data(torch.distributed.get_world_size(), 4)[(step + offset) % 4][rank])
        else:
            ids = (torch.arange(6) * (step + offset + 1) + rank).remainder(32).unsqueeze(0)
            loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _values(engine):
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def _resume(kind, stage, ep, directory):
    from deepspeed.utils import groups
    if "+offload" in kind:  # the pipelined host step: the unit step overlapping the next forward
        os.environ["DS_NATIVE_CPU_ADAM"] = "1"
    try:
        return _resume_run(kind, stage, ep, directory, groups)
    finally:
        os.environ.pop("DS_NATIVE_CPU_ADAM", None)


def _resume_run(kind, stage, ep, directory, groups):
    engine, _ = _engine(kind, stage, ep, 0)
    if "+offload" in kind:
        assert engine._stage.unit_step is not None
    _train(engine, kind, 2, 0)
    engine.save_checkpoint(directory, tag="t")
    want_losses = _train(engine, kind, 2, 2)
    want = _values(engine)
    engine.destroy()
    engine, _ = _engine(kind, stage, ep, 1)
    engine.load_checkpoint(directory, tag="t")
    got_losses = _train(engine, kind, 2, 2)
    got = _values(engine)
    engine.destroy()
    groups.reset_mesh()
    files = sorted(os.listdir(os.path.join(directory, "t")))
    bad = [n for n in want if not torch.equal(want[n], got[n])]
    return got_losses == want_losses, bad, files


@pytest.mark.parametrize("kind, stage, ep", [("moe", 0, 2), ("moe", 2, 2), ("autoep", 1, 2), ("autoep", 3, 1),
                                             ("moe", 3, 2), ("autoep", 3, 2), ("moe+offload", 3, 2)])
def test_resume_is_exact(kind, stage, ep, tmp_path):
    results = run_distributed(_resume, 2, args=(kind, stage, ep, str(tmp_path)), timeout=T)
    for same_losses, bad, files in results:
        assert same_losses and bad == [], bad
    files = results[0][2]
    layers = 1 if kind.startswith("moe") else 2
    for layer in range(layers):
        for e in range(4):
            assert f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" in files
    assert {f"expp_rank_{r}_mp_rank_00_expert_states.pt" for r in range(ep)} <= set(files)


def _reshard(kind, stage, directory, targets=((1, None), (4, None))):
    """Save at ep 2, load (fully: optimizer state too) at each ``(ep, stage)`` of ``targets`` (None: the saving
    stage): the next losses and values equal the continued run's (its experts read on their new ranks)."""
    from deepspeed.utils import groups
    engine, _ = _engine(kind, stage, 2, 0)
    _train(engine, kind, 2, 0)
    engine.save_checkpoint(directory, tag="t")
    want_losses = _train(engine, kind, 2, 2)
    want = _global_values(engine)
    engine.destroy()
    bad = []
    for ep, load_stage in targets:
        groups.reset_mesh()
        engine, _ = _engine(kind, stage if load_stage is None else load_stage, ep, 1)
        engine.load_checkpoint(directory, tag="t")
        got_losses = _train(engine, kind, 2, 2)
        got = _global_values(engine)
        engine.destroy()
        assert sorted(got) == sorted(want)  # every expert, whichever rank holds it
        if ep == 2 and load_stage in (None, stage):  # the saving layout: an exact resume
            bad += [f"ep {ep}: losses {got_losses} vs {want_losses}"] if got_losses != want_losses else []
            bad += [f"ep {ep}: {n} not bitwise" for n in want if not torch.equal(got[n], want[n])]
            continue
        if any(abs(a - b) > 1e-5 * abs(b) for a, b in zip(got_losses, want_losses)):
            bad.append(f"ep {ep}: losses {got_losses} vs {want_losses}")
        bad += [f"ep {ep}: {n}" for n in want if not torch.allclose(got[n], want[n], rtol=1e-5, atol=1e-7)]
    groups.reset_mesh()
    return bad


def _global_values(engine):
    """name (experts by global index) -> fp32 value, every rank's experts (gathered)."""
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, _rank_values(engine))
    return {k: v for values in everyone for k, v in values.items()}


def _rank_values(engine):
    """name (experts by global index) -> fp32 value, this rank's experts only."""
    from deepspeed.moe.autoep import GroupedExperts
    out = {}
    for name, value in _values(engine).items():
        module = engine.module.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(module, GroupedExperts):
            for row in range(module.num_local_experts):
                out[f"{name}.{module.first_expert + row}"] = value[row]
        elif ".deepspeed_experts." in name:
            head, local, rest = name.split(".deepspeed_experts.")[0], *name.split(".deepspeed_experts.")[1].split(
                ".", 1)
            e = engine.module.moe.global_expert_indices[int(local)]
            out[f"{head}.{e}.{rest}"] = value
        else:
            out[name] = value
    return out


def _reshard_cells(directory):
    cells = [("moe", 2, "moe", ((1, None), (4, None))), ("autoep", 1, "ep", ((1, None), (4, None), (1, 3), (2, 3))),
             ("autoep", 3, "z3", ((4, None), (2, 1))), ("moe+offload", 3, "z3off", ((4, None), (1, 2))),
             ("moe+offload+offparam", 3, "z3offp", ((2, None), (4, None), (1, None)))]
    return [
        bad for kind, stage, sub, targets in cells
        for bad in _reshard(kind, stage, os.path.join(directory, sub), targets)
    ]


def test_reshard_across_expert_parallel_sizes(tmp_path):
    """The MoE layer on ZeRO 2 and AutoEP (Mixtral) on ZeRO 1, Adam, world 4: saved at ep 2, loaded at 1 and 4 (AutoEP
    also into ZeRO-3 at ep 1 and 2); AutoEP saved on ZeRO-3 at ep 2 (experts sharded over their expert-data-parallel
    group), loaded on ZeRO-3 at ep 4 and on ZeRO 1 at ep 2; the MoE layer saved on ZeRO-3 at ep 2 with the optimizer
    offloaded, loaded (offloaded) on ZeRO-3 at ep 4 and on ZeRO 2 at ep 1; saved on ZeRO-3 at ep 2 with the optimizer
    and the parameters offloaded, loaded so at ep 2 (an exact resume: the same bits), 4 and 1."""
    assert run_distributed(_reshard_cells, 4, args=(str(tmp_path), ), timeout=T) == [[]] * 4


def _other_ep(directory):
    from deepspeed.runtime.checkpoint.validate import CheckpointError
    from deepspeed.utils import groups
    engine, model = _engine("moe", 0, 2, 0)
    _train(engine, "moe", 1, 0)
    engine.save_checkpoint(directory, tag="t")
    rank = torch.distributed.get_rank()
    saved = {
        f"{e}": [p.detach().clone() for p in model.moe.deepspeed_moe.experts.deepspeed_experts[i].parameters()]
        for i, e in enumerate(model.moe.global_expert_indices)
    }
    engine.destroy()
    engine, model = _engine("moe", 0, 1, 1)
    try:
        engine.load_checkpoint(directory, tag="t")
        full = "no error"
    except CheckpointError as err:
        full = "CheckpointError" if "load_module_only" in str(err) else str(err)
    engine.load_checkpoint(directory, tag="t", load_module_only=True)
    experts = model.moe.deepspeed_moe.experts.deepspeed_experts
    mine = [experts[int(e)] for e in saved]  # this rank's saved experts, now at their global index
    same = all(torch.equal(p, q) for e, m in zip(saved, mine) for p, q in zip(saved[e], m.parameters()))
    engine.destroy()
    groups.reset_mesh()
    return full, same, rank


def test_stage0_checkpoint_other_expert_parallel_size_loads_the_module_only(tmp_path):
    """ZeRO 0 keeps rank 0's experts' optimizer state only: a full load at another size raises on every rank
    before anything changes; the module loads (each rank's experts from the per-expert files)."""
    for full, same, _ in run_distributed(_other_ep, 2, args=(str(tmp_path), ), timeout=T):
        assert full == "CheckpointError" and same


def _from_upstream(fixture, targets):
    """An upstream 0.19.8 AutoEP checkpoint (ep 2) loaded at each ``(expert-parallel size, ZeRO stage)`` of
    ``targets`` (fresh engines, other initial weights): the next two losses equal those upstream recorded when it
    continued."""
    import deepspeed
    from deepspeed.utils import groups
    from tests.unit.checkpoint.upstream.write_autoep_fixtures import TAG, ds_config, model_overrides, tokens
    from tests.unit.moe.autoep_models import mixtral
    rank = torch.distributed.get_rank()
    want = torch.load(os.path.join(fixture, "trajectory.pt"))["losses"][rank]
    bad = []
    overrides = model_overrides(torch.distributed.get_world_size())
    for ep, stage in targets:
        config = ds_config(False, stage)
        config["expert_parallel"]["autoep_size"] = ep
        engine, _, _, _ = deepspeed.initialize(model=mixtral(seed=9, **overrides), config=config)
        engine.load_checkpoint(fixture, tag=TAG)
        got = []
        for step in (2, 3):
            ids = tokens(step, rank)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            got.append(float(loss.detach()))
        engine.destroy()
        groups.reset_mesh()
        if any(abs(a - b) > 1e-6 * abs(b) for a, b in zip(got, want)):
            bad.append(f"ep {ep}, ZeRO {stage}: {got} vs upstream's {want}")
    return bad


def _fixture(cell):
    return os.path.join(os.path.dirname(os.path.dirname(__file__)), "checkpoint", "upstream", "fixtures_autoep", cell)


def test_upstream_autoep_checkpoint_loads_and_continues():
    assert run_distributed(_from_upstream, 2, args=(_fixture("ep2-z1"), ((2, 1), (1, 1))), timeout=T) == [[], []]


def test_upstream_autoep_checkpoint_split_over_expert_data_parallel_ranks():
    """World 4 at ep 2, ZeRO 2: each expert-data-parallel group holds two ranks, which split the experts'
    partitions between them in upstream's files (one parameter in two fragments); loaded at ep 2, 4 and 1 (ZeRO-3)."""
    targets = ((2, 2), (4, 2), (1, 3))
    assert run_distributed(_from_upstream, 4, args=(_fixture("ep2-z2-w4"), targets), timeout=T) == [[]] * 4


@pytest.mark.parametrize("cell, world, targets", [("ep2-z3", 2, ((2, 3), (1, 1))), ("ep2-z3-w4", 4, ((2, 3), (4, 2)))])
def test_upstream_autoep_zero3_checkpoint_loads_and_continues(cell, world, targets):
    """Upstream's ZeRO-3 AutoEP saves (experts in the optimizer partitions, no per-expert files): at ep 2 on 2 ranks
    (one rank per expert-data-parallel group) and on 4 ranks (each expert parameter sharded over two), loaded onto
    ZeRO-3 at ep 2 and onto ZeRO 1 or 2 at another size."""
    assert run_distributed(_from_upstream, world, args=(_fixture(cell), targets), timeout=T) == [[]] * world
