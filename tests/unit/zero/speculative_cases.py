# SPDX-License-Identifier: Apache-2.0
"""What the speculative-step tests share (``test_speculative_offload*.py``): the environment of a pipelined run,
the training loop with forced clips, overflows and LR changes, the optimizer state read after it, the
bit-for-bit comparison of an exact and a speculative run, and the reads between backward and step()."""

import contextlib
import os

import torch

from deepspeed.runtime.zero.offload.step_pipeline import StepPipeline

MODEL_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def with_precision(config, dtype):
    """``config`` with the precision section of ``dtype`` ("bf16", "fp16" or "fp32")."""
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


@contextlib.contextmanager
def pipelined(dtype, delay):
    """The pipelined offloaded step (an fp32 model on the host op), every piece slowed by ``delay`` seconds."""
    os.environ["DS_OFFLOAD_OVERLAP"] = "1"
    if dtype == "fp32":  # an fp32 model is pipelined only on the host op
        os.environ["DS_NATIVE_CPU_ADAM"] = "1"
    StepPipeline.piece_delay = delay
    try:
        yield
    finally:
        StepPipeline.piece_delay = 0.0
        os.environ.pop("DS_OFFLOAD_OVERLAP", None)
        os.environ.pop("DS_NATIVE_CPU_ADAM", None)


def train_steps(engine,
                dtype,
                steps,
                gas,
                clip,
                *,
                clip_at=(),
                inf_at=(),
                lr_change_at=(),
                twice=False,
                record_second=False):
    """``steps`` optimizer steps of ``gas`` micro-steps; the losses. ``clip_at``: steps whose clipping threshold is
    far below the norm; ``inf_at``: steps whose boundary loss is infinite; ``lr_change_at``: steps whose LR is
    halved between the boundary backward and ``step()``; ``twice``: the boundary micro-step runs a second forward
    and backward (its loss recorded with ``record_second``)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    gen = torch.Generator().manual_seed(100 + rank)
    model_dtype = MODEL_DTYPES[dtype]
    losses = []
    for step in range(steps):
        for micro in range(gas):
            x = torch.randn(2, 7, generator=gen).to(model_dtype)
            y = torch.randn(2, 3, generator=gen)
            loss = torch.nn.functional.mse_loss(engine(x).float(), y) * 5.0
            boundary = micro == gas - 1
            if boundary and step in inf_at:
                loss = loss * float("inf")
            engine.backward(loss)
            if boundary and twice:
                x2 = torch.randn(2, 7, generator=gen).to(model_dtype)
                second = engine(x2).float().square().mean()
                engine.backward(second)
                if record_second:
                    losses.append(second.item())
            if boundary and step in clip_at:
                engine.optimizer.gradient_clipping = 1e-3
            if boundary and step in lr_change_at:
                for group in engine.optimizer.param_groups:
                    group["lr"] *= 0.5
            engine.step()
            engine.optimizer.gradient_clipping = clip
            losses.append(loss.item())
    return losses


def optimizer_state(stage):
    """Copies of the stage's fp32 masters, and of their Adam moments and step counts."""
    stage._masters_current()
    masters = [m.detach().clone() for m in stage.masters]
    moments = []
    for master in stage.masters:
        state = stage.optimizer.state.get(master, {})
        moments += [state[k].clone() for k in ("exp_avg", "exp_avg_sq") if k in state]
        if "step" in state:
            moments.append(torch.as_tensor(float(state["step"])))
    return masters, moments


def check_read_before_step(engine, model):
    """Reads of the fp32 masters (``model.head.weight``'s) and of the optimizer's state_dict between a boundary
    backward and ``step()`` roll the speculation back and see the state before the step; ``step()`` then steps."""
    from deepspeed.utils import safe_get_full_fp32_param
    before = safe_get_full_fp32_param(model.head.weight).clone()
    engine.backward(engine(torch.randn(2, 7, dtype=torch.bfloat16)).float().square().mean())
    assert torch.equal(safe_get_full_fp32_param(model.head.weight), before)
    stats = engine.optimizer.speculative_stats
    assert stats["rolled_back"] == 1 and stats["reasons"]["read"] == 1, stats
    engine.step()
    # the optimizer's state_dict between a boundary backward and step() shows the state before the step
    saved = engine.optimizer.state_dict()["optimizer"]["state"]
    steps_before = sorted(float(s["step"]) for s in saved.values())
    engine.backward(engine(torch.randn(2, 7, dtype=torch.bfloat16)).float().square().mean())
    saved = engine.optimizer.state_dict()["optimizer"]["state"]
    assert sorted(float(s["step"]) for s in saved.values()) == steps_before
    assert stats["reasons"]["read"] == 2, stats
    engine.step()
    assert not torch.equal(safe_get_full_fp32_param(model.head.weight), before)


def assert_same(exact, speculative):
    """Runs ``(losses, params, masters, moments, stats, pieces, skipped_steps)``: the same bits throughout."""
    assert exact[0] == speculative[0], f"losses differ: {exact[0]} vs {speculative[0]}"
    for name, a_list, b_list in zip(("params", "masters", "moments"), exact[1:4], speculative[1:4]):
        assert len(a_list) == len(b_list) and a_list, name
        for a, b in zip(a_list, b_list):
            assert torch.equal(a, b), f"{name} differ"
    assert exact[6] == speculative[6], "skipped steps differ"
    assert exact[4] is None
