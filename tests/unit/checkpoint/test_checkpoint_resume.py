# SPDX-License-Identifier: Apache-2.0
"""Resume is exact: 3 steps + save + load into a fresh engine + 3 steps == 6 uninterrupted steps, bitwise.

Every ZeRO stage (0, 1, 2) x dtype (fp32, bf16, fp16 with a dynamic loss scale that
changes before the save and again after it) x GAS (1, 2), with AdamW and WarmupLR
(its warmup spans the save). Compared bitwise: every fp32 parameter, the model's own
parameters, ``exp_avg``, ``exp_avg_sq`` and ``step``, the learning rates, the LR
schedule, the loss scaler's state and the counters.

This module also holds the helpers the other checkpoint tests use (imported as a
module, so that pytest does not collect its tests twice).
"""

import os

import pytest
import torch

from tests.unit.common import run_distributed

DTYPES = ("fp32", "bf16", "fp16")
LOSS_SCALE_POWER = 8
LR = 0.02


def attach_checkpointing():
    """Give DeepSpeedEngine the checkpoint methods (until engine.py inherits the mixin)."""
    from deepspeed.runtime.checkpoint.engine_mixin import attach
    from deepspeed.runtime.engine import DeepSpeedEngine
    attach(DeepSpeedEngine)


def make_config(stage, dtype, gas=1, micro=2, bucket=40, scheduler=True, clip=1.0, offload=False):
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": float("inf"),
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": LR,
                "weight_decay": 0.01
            }
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket
        },
    }
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if scheduler:
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": LR,
                "warmup_num_steps": 5
            }
        }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {
            "enabled": True,
            "initial_scale_power": LOSS_SCALE_POWER,
            "hysteresis": 1,
            "loss_scale_window": 2
        }
    return cfg


def build_model(seed, frozen=False, tie=False, dim=None):
    from tests.unit.contract import models
    torch.manual_seed(seed)
    if dim is None:
        model = models.ToyNet(tie=tie)
    else:
        saved = models.DIM
        models.DIM = dim
        try:
            model = models.ToyNet(tie=tie)
        finally:
            models.DIM = saved
    if frozen:
        model.block2.bias.requires_grad_(False)
    return model


def build_engine(cfg, seed, frozen=False, tie=False, dim=None):
    import deepspeed
    model = build_model(seed, frozen=frozen, tie=tie, dim=dim)
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def train(engine, steps, start, rank, inf_step=None, batch_fn=None):
    """``steps`` optimizer steps from step ``start``; the loss of ``inf_step``'s first micro-step is made inf."""
    from tests.unit.contract.models import lm_loss, make_batch
    gas = engine.gradient_accumulation_steps()
    for step in range(start, start + steps):
        for micro in range(gas):
            tokens, targets = batch_fn(step, micro) if batch_fn else make_batch(rank, step * gas + micro)
            loss = lm_loss(engine(tokens), targets)
            if step == inf_step and micro == 0:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()


def snapshot(engine):
    """Collective (stages 1/2 gather): everything a resumed run must reproduce, as CPU tensors and numbers."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    snap = {}
    for name, param in engine.module.named_parameters():
        snap[f"model/{name}"] = param.detach().cpu().clone()
        if param.requires_grad:
            snap[f"fp32/{name}"] = safe_get_full_fp32_param(param).cpu()
            for key in ("exp_avg", "exp_avg_sq", "step"):
                value = safe_get_full_optimizer_state(param, key)
                snap[f"{key}/{name}"] = None if value is None else value.cpu()
    snap["lr"] = list(engine.get_lr())
    snap["loss_scaler"] = dict(engine.loss_scaler.state_dict())
    snap["counters"] = (engine.global_steps, engine.global_samples, engine.skipped_steps)
    snap["scheduler"] = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    return snap


def differences(expected, actual):
    """Names of the snapshot entries that are not bitwise equal."""
    bad = []
    for key in sorted(set(expected) | set(actual)):
        a, b = expected.get(key), actual.get(key)
        if torch.is_tensor(a) and torch.is_tensor(b):
            if a.dtype != b.dtype or a.shape != b.shape:
                bad.append(f"{key}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
            elif not torch.equal(a, b):
                bad.append(f"{key}: max diff {(a.double() - b.double()).abs().max().item()}")
        elif a != b:
            bad.append(f"{key}: {a!r} != {b!r}")
    return bad


# What upstream's load_checkpoint consumes from the model-states file it reads, by argument: the module always;
# the counters and world sizes unless only the module is loaded; the scheduler and the optimizer when it loads them.
UPSTREAM_CONSUMED = ("sparse_tensor_module_names", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size",
                     "data_sampler", "random_ltd")


def upstream_client_state(path,
                          stage,
                          load_optimizer_states=True,
                          load_lr_scheduler_states=True,
                          load_module_only=False,
                          has_optimizer=True):
    """The client state upstream's load_checkpoint returns for the model-states file ``path``.

    Every entry it does not consume; an engine without ZeRO partitions (stage 0, with an
    optimizer) that loaded optimizer states also gets the file's ``optimizer`` entry back.
    """
    saved = torch.load(path, map_location="cpu", weights_only=False)
    consumed = {"module"}
    if not load_module_only:
        consumed.update(UPSTREAM_CONSUMED)
    if load_lr_scheduler_states:
        consumed.add("lr_scheduler")
    if load_optimizer_states:
        consumed.add("optimizer")
    expected = {key: value for key, value in saved.items() if key not in consumed}
    if stage == 0 and has_optimizer and load_optimizer_states and not load_module_only:
        expected["optimizer"] = saved["optimizer"]
    return expected


def same_content(a, b):
    """Deep equality of checkpoint entries (tensors bitwise, dicts by keys and order-free)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(same_content(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_content(x, y) for x, y in zip(a, b))
    return a == b


def resume_worker(tmp, stage, dtype, gas, offload=False):
    import deepspeed.comm as dist
    attach_checkpointing()
    rank = dist.get_rank()
    cfg = make_config(stage, dtype, gas, offload=offload)
    inf_step = 1 if dtype == "fp16" else None
    model = dict(frozen=True, tie=True)  # a frozen parameter and a tied weight

    straight = build_engine(cfg, seed=0, **model)
    train(straight, 6, 0, rank, inf_step)
    expected = snapshot(straight)
    straight.destroy()

    first = build_engine(cfg, seed=0, **model)
    train(first, 3, 0, rank, inf_step)
    if dtype == "fp16":
        assert first.get_loss_scale() == 2.0**(LOSS_SCALE_POWER - 1) and first.skipped_steps == 1
    assert first.save_checkpoint(tmp, client_state={"epoch": 3, "note": "resume"}) is True
    first.destroy()

    resumed = build_engine(cfg, seed=1, **model)  # other initial weights: a load that did nothing cannot pass
    groups = list(resumed.optimizer.param_groups)
    path, client_state = resumed.load_checkpoint(tmp)
    assert all(a is b for a, b in zip(groups, resumed.optimizer.param_groups)), "param-group dicts were replaced"
    assert path == os.path.join(tmp, "global_step3", "mp_rank_00_model_states.pt"), path
    assert client_state["epoch"] == 3 and client_state["note"] == "resume", client_state
    assert same_content(client_state, upstream_client_state(path, stage)), sorted(client_state)
    train(resumed, 3, 3, rank, inf_step)
    actual = snapshot(resumed)
    resumed.destroy()
    bad = differences(expected, actual)
    assert not bad, f"rank {rank}: resumed run differs from the uninterrupted one: {bad}"
    if dtype == "fp16":  # halved at step 1, doubled at steps 3 and 5 (window 2): the scaler's window was restored
        assert actual["loss_scaler"]["cur_scale"] == 2.0**(LOSS_SCALE_POWER + 1), actual["loss_scaler"]
    return sorted(n for n in os.listdir(os.path.join(tmp, "global_step3")) if not n.startswith("."))


def _cells():
    cells = [(stage, dtype, gas, 2, False) for stage in (0, 1, 2) for dtype in DTYPES for gas in (1, 2)]
    cells += [(1, "fp32", 2, 3, False), (2, "bf16", 2, 3, False), (2, "fp16", 1, 3, False), (0, "bf16", 1, 1, False),
              (2, "fp32", 2, 1, False), (2, "bf16", 2, 2, True), (1, "fp16", 1, 3, True)]
    return cells


CELLS = _cells()


@pytest.mark.parametrize("stage,dtype,gas,world,offload",
                         CELLS,
                         ids=[f"z{s}-{d}-gas{g}-w{w}{'-offload' if o else ''}" for s, d, g, w, o in CELLS])
def test_resume_is_exact(tmp_path, stage, dtype, gas, world, offload):
    files = run_distributed(resume_worker, world, args=(str(tmp_path), stage, dtype, gas, offload), timeout=120)
    expected = ["mp_rank_00_model_states.pt"]
    prefix = "bf16_" if dtype == "bf16" else ""
    if stage > 0:
        expected += [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    assert files[0] == sorted(expected)
    assert (tmp_path / "latest").read_text() == "global_step3"
