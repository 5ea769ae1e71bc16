# SPDX-License-Identifier: Apache-2.0
"""ZenFlow against a plain-torch model of its algorithm (``reference.py``), on gloo ranks.

* the algorithm: ZeRO 1/2 and 3 with CPU offload, worlds 1 and 2 (partitions cut rows and
  columns there), with and without ``overlap_step``, fixed and "auto" update intervals, warm-up,
  clipping, bf16, several host windows and selections: every ``engine.step()`` is a ZenFlow step
  (also with ``gradient_accumulation_steps`` 2 in the config, as upstream), and after every one
  the model's parameters equal the reference's, and at the end the fp32 values
  (``safe_get_full_fp32_param``) too. The reference computes its own gradients;
* fp16: the reference steps the engine's reduced gradients (read before each step), so the
  algorithm is compared exactly; an overflow on one rank skips the step on every rank (both
  parts), lowers the loss scale and leaves every parameter as it was;
* a checkpoint saved in the middle of a host window (with a host step pending) resumes to
  the same parameters as the run that was never interrupted;
* bad configs raise the same clear error on every rank.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.unit.common import run_distributed

VOCAB, DIM, HIDDEN = 12, 6, 10


class ZFNet(nn.Module):
    """Weights of several column counts (an embedding, two linears) and biases (always on the device)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        return self.fc2(torch.tanh(self.fc1(self.emb(tokens))))


def batch(rank, step, micro):
    gen = torch.Generator().manual_seed(7919 * rank + 131 * step + micro + 3)
    tokens = torch.randint(0, VOCAB, (2, 3), generator=gen)
    return tokens, torch.randint(0, VOCAB, (2, 3), generator=gen)


def loss_of(model, tokens, targets):
    return F.cross_entropy(model(tokens).float().reshape(-1, VOCAB), targets.reshape(-1))


LR, CLIP = 0.05, 1.0


def config(stage, gas, zenflow, dtype="fp32", bucket=37):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
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
            "reduce_bucket_size": bucket,
            "offload_optimizer": {
                "device": "cpu"
            },
            "zenflow": zenflow
        },
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    return cfg


def reference_for(model, zenflow):
    from tests.unit.zenflow.reference import ZenFlowReference
    return ZenFlowReference.from_config(dict(model.named_parameters()), zenflow, lr=LR, weight_decay=0.01, clip=CLIP)


def reference_grads(model, values, world, step, micro):
    """One micro-batch's gradient, the mean over every rank's, at ``values`` (plain torch, fp32)."""
    probe = copy.deepcopy(model).float()
    with torch.no_grad():
        for n, p in probe.named_parameters():
            p.copy_(values[n])
    probe.zero_grad(set_to_none=True)
    for r in range(world):
        loss_of(probe, *batch(r, step, micro)).backward()
    return {n: p.grad / world for n, p in probe.named_parameters()}


def train(engine, rank, steps, gas, first_step=0):
    """``steps`` x ``gas`` micro-batches, each with its ``engine.step()`` (each a ZenFlow step)."""
    for step in range(first_step, first_step + steps):
        for m in range(gas):
            engine.backward(loss_of(engine, *batch(rank, step, m)))
            engine.step()


def slow_host_worker():
    """Make every accumulation start late on the host worker, so the next backward runs while it still has to read
    its partitions (they must be the other set by then)."""
    import time
    from deepspeed.runtime.zenflow.host_window import HostWindow
    original = HostWindow.accumulate

    def accumulate(self, parts, coef):
        if self.acc_worker is not None:  # the host path (on the device the sum is stream-ordered)
            self.acc_worker.submit(lambda: time.sleep(0.05))
        return original(self, parts, coef)

    HostWindow.accumulate = accumulate
    return lambda: setattr(HostWindow, "accumulate", original)


def model_values(engine, stage):
    """The model's parameters as the next forward computes with them (ZeRO-3: gathered), as fp32."""
    import deepspeed
    params = list(engine.module.parameters())
    if stage != 3:
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def run_against_reference(stage, gas, zenflow, dtype, steps, slow_worker=False, offload_param=False):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param
    rank, world = dist.get_rank(), dist.get_world_size()
    restore = slow_host_worker() if slow_worker else (lambda: None)
    torch.manual_seed(0)
    model = ZFNet()
    ref = reference_for(model, zenflow)
    cfg = config(stage, gas, zenflow, dtype)
    if offload_param:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine = deepspeed.initialize(model=copy.deepcopy(model), config=cfg)[0]
    assert engine.gradient_accumulation_steps() == 1  # every engine.step() is a ZenFlow step
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "fp32" else dict(rtol=1e-2, atol=1e-2)
    checked = 0
    try:
        for step in range(steps):
            micro = step % gas
            grads = reference_grads(model, ref.Q, world, step // gas, micro)
            engine.backward(loss_of(engine, *batch(rank, step // gas, micro)))
            engine.step()
            ref.step(grads)
            for name, value in model_values(engine, stage).items():
                torch.testing.assert_close(value, ref.Q[name], **tol, msg=lambda m: f"step {step} {name}: {m}")
                checked += 1
        expected = ref.fp32_values()
        for name, p in engine.module.named_parameters():
            torch.testing.assert_close(safe_get_full_fp32_param(p), expected[name], **tol)
    finally:
        engine.destroy()
        restore()
    return checked


CASES = {
    # gradient_accumulation_steps 2 in the config: still one ZenFlow step per micro-batch (upstream's accounting)
    "z2-w1-gas2":
    dict(stage=2,
         world=1,
         gas=2,
         zenflow=dict(topk_ratio=0.3, update_interval=2, select_strategy="step", select_interval=4)),
    "z2-w1-overlap-warmup":
    dict(stage=2,
         world=1,
         gas=1,
         zenflow=dict(topk_ratio=0.25,
                      update_interval=3,
                      select_strategy="step",
                      select_interval=3,
                      overlap_step=True,
                      full_warm_up_rounds=2)),
    # one warm-up round, windows of 2, a selection every 2: upstream's schedule closes a window before every
    # selection, so every step after the first selection closes one (the CPU probe's configuration)
    "z2-w2-overlap-warmup-odd":
    dict(stage=2,
         world=2,
         gas=1,
         zenflow=dict(topk_ratio=0.3,
                      update_interval=2,
                      select_strategy="step",
                      select_interval=2,
                      overlap_step=True,
                      full_warm_up_rounds=1)),
    "z1-w2":
    dict(stage=1,
         world=2,
         gas=2,
         zenflow=dict(topk_ratio=0.2, update_interval=3, select_strategy="step", select_interval=6)),
    "z2-w2-auto":
    dict(stage=2,
         world=2,
         gas=1,
         zenflow=dict(topk_ratio=0.3,
                      update_interval="auto",
                      select_strategy="step",
                      select_interval=4,
                      overlap_step=True,
                      auto_ratio=0.5)),
    "z2-w2-offload-bf16":
    dict(stage=2,
         world=2,
         gas=1,
         dtype="bf16",
         zenflow=dict(topk_ratio=0.3, update_interval=2, select_strategy="step", select_interval=4, offload=True)),
    "z2-w1-all-columns":
    dict(stage=2,
         world=1,
         gas=1,
         zenflow=dict(topk_ratio=1.0, update_interval=2, select_strategy="step", select_interval=2)),
    # the window update and the overlapped host step's apply point: "repeat" applied 1 step after its launch,
    # "sqrt", "scaled" applied 2 steps after (mid-window), and upstream's ("once", applied when the next window
    # closes) with windows of 4 that a selection every 6 cuts
    "z2-w2-overlap-cut-windows":
    dict(stage=2,
         world=2,
         gas=1,
         zenflow=dict(topk_ratio=0.3, update_interval=4, select_strategy="step", select_interval=6,
                      overlap_step=True)),
    "z1-w2-repeat-apply1":
    dict(stage=1,
         world=2,
         gas=1,
         zenflow=dict(topk_ratio=0.2,
                      update_interval=3,
                      select_strategy="step",
                      select_interval=6,
                      overlap_step=True,
                      overlap_apply_after=1,
                      window_update="repeat")),
    "z2-w2-sqrt-overlap":
    dict(stage=2,
         world=2,
         gas=1,
         zenflow=dict(topk_ratio=0.3,
                      update_interval=3,
                      select_strategy="step",
                      select_interval=6,
                      overlap_step=True,
                      window_update="sqrt")),
    "z2-w2-scaled-apply2":
    dict(stage=2,
         world=2,
         gas=1,
         zenflow=dict(topk_ratio=0.3,
                      update_interval=4,
                      select_strategy="step",
                      select_interval=4,
                      overlap_step=True,
                      overlap_apply_after=2,
                      window_update="scaled")),
    "z2-w1-slow-worker":
    dict(stage=2,
         world=1,
         gas=1,
         slow_worker=True,
         zenflow=dict(topk_ratio=0.3,
                      update_interval=2,
                      select_strategy="step",
                      select_interval=4,
                      overlap_step=True,
                      offload=True)),
    # ZeRO-3: shards cut rows and columns at world 2; the 16-bit shards on the device, or on the host
    "z3-w1-overlap-warmup":
    dict(stage=3,
         world=1,
         gas=2,
         zenflow=dict(topk_ratio=0.25,
                      update_interval=3,
                      select_strategy="step",
                      select_interval=3,
                      overlap_step=True,
                      full_warm_up_rounds=2)),
    "z3-w2":
    dict(stage=3,
         world=2,
         gas=1,
         zenflow=dict(topk_ratio=0.3, update_interval=2, select_strategy="step", select_interval=4)),
    "z3-w2-auto-offload-param":
    dict(stage=3,
         world=2,
         gas=1,
         offload_param=True,
         zenflow=dict(topk_ratio=0.3,
                      update_interval="auto",
                      select_strategy="step",
                      select_interval=4,
                      overlap_step=True,
                      auto_ratio=0.5)),
    "z3-w2-bf16-offload-apply1":
    dict(stage=3,
         world=2,
         gas=1,
         dtype="bf16",
         zenflow=dict(topk_ratio=0.3,
                      update_interval=2,
                      select_strategy="step",
                      select_interval=4,
                      offload=True,
                      overlap_step=True,
                      overlap_apply_after=1)),
}
STEPS = 9


@pytest.mark.parametrize("case", sorted(CASES))
def test_zenflow_matches_reference(case):
    c = CASES[case]
    checked = run_distributed(run_against_reference,
                              c["world"],
                              args=(c["stage"], c["gas"], c["zenflow"], c.get("dtype", "fp32"), STEPS,
                                    c.get("slow_worker", False), c.get("offload_param", False)),
                              timeout=120)
    assert all(n == STEPS * 5 for n in checked), checked  # 9 steps x 5 parameters


# ------------------------------------------------------------------------ fp16
def fp16_overflow_skip(overflow_step):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_grad
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = ZFNet()
    zenflow = dict(topk_ratio=0.3, update_interval=2, select_strategy="step", select_interval=2, overlap_step=True)
    ref = reference_for(model, zenflow)
    engine = deepspeed.initialize(model=copy.deepcopy(model), config=config(2, 1, zenflow, "fp16"))[0]
    skipped_ok = []
    try:
        for step in range(9):
            before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
            scale_before = engine.get_loss_scale()
            loss = loss_of(engine, *batch(rank, step, 0))
            if step == overflow_step and rank == world - 1:
                loss = loss * float("inf")  # only the last rank overflows
            engine.backward(loss)
            grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
            engine.step()
            norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
            if step == overflow_step:
                assert not math.isfinite(norm)
                assert not engine.was_step_applied()
                assert engine.get_loss_scale() == scale_before / 2
                for n, p in engine.module.named_parameters():
                    assert torch.equal(p.detach(), before[n]), f"{n} changed in the skipped step"
                skipped_ok.append(step)
                continue
            assert engine.was_step_applied()
            ref.step(grads)
            for n, p in engine.module.named_parameters():
                torch.testing.assert_close(p.detach().float(), ref.Q[n], rtol=2e-3, atol=2e-3)
        assert engine.skipped_steps == 1
        assert engine._stage.zenflow.steps == 8  # the skipped step did not count
    finally:
        engine.destroy()
    return skipped_ok


def test_fp16_overflow_skips_both_parts_on_every_rank():
    assert run_distributed(fp16_overflow_skip, 2, args=(3, ), timeout=120) == [[3], [3]]


# ----------------------------------------------------------------- checkpoints
def resume_mid_window(save_dir, total, cut, stage, offload_param=False):
    import deepspeed
    import deepspeed.comm as dist
    rank = dist.get_rank()
    # windows of 3 ZenFlow steps, a selection every 12, two micro-batches (ZenFlow steps) per loop step: after 4
    # loop steps (8 ZenFlow steps) two steps of the third window are accumulated and the second window's host
    # step is done but not applied yet
    zenflow = dict(topk_ratio=0.3, update_interval=3, select_strategy="step", select_interval=12, overlap_step=True)
    cfg = config(stage, 2, zenflow)
    if offload_param:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    torch.manual_seed(0)
    model = ZFNet()
    straight = deepspeed.initialize(model=copy.deepcopy(model), config=cfg)[0]
    train(straight, rank, total, 2)
    expected = model_values(straight, stage)
    straight.destroy()

    first = deepspeed.initialize(model=copy.deepcopy(model), config=cfg)[0]
    train(first, rank, cut, 2)
    zf = first._stage.zenflow
    assert zf.window.count not in (0, None) and zf.pending_apply, "the cut is not in the middle of a window"
    first.save_checkpoint(save_dir, tag="mid")
    first.destroy()

    torch.manual_seed(1)
    second = deepspeed.initialize(model=ZFNet(), config=cfg)[0]
    second.load_checkpoint(save_dir, tag="mid")
    train(second, rank, total - cut, 2, first_step=cut)
    for n, value in model_values(second, stage).items():
        torch.testing.assert_close(value, expected[n], rtol=1e-6, atol=1e-7)
    second.destroy()
    return True


@pytest.mark.parametrize("stage,offload_param", [(2, False), (3, False), (3, True)])
def test_save_load_mid_window_resumes_exactly(tmp_path, stage, offload_param):
    assert run_distributed(resume_mid_window, 2, args=(str(tmp_path), 9, 4, stage, offload_param),
                           timeout=120) == [True, True]


# ----------------------------------------------------------------- bad configs
BAD = {
    "topk_zero": (2, dict(topk_ratio=0.0), "topk_ratio"),
    "topk_above_one": (2, dict(topk_ratio=1.5), "topk_ratio"),
    "interval_without_strategy": (2, dict(select_interval=4), "select_strategy"),
    "strategy_without_interval": (2, dict(select_strategy="step"), "select_interval"),
    "stage0": (0, dict(topk_ratio=0.1), "stage 1, 2 or 3"),
    "window_update_unknown": (2, dict(window_update="twice"), "window_update"),
    "apply_after_zero": (2, dict(overlap_apply_after=0), "overlap_apply_after"),
    "apply_after_word": (2, dict(overlap_apply_after="soon"), "overlap_apply_after"),
}


def bad_config(stage, zenflow):
    import deepspeed
    cfg = config(stage, 1, zenflow)
    try:
        deepspeed.initialize(model=ZFNet(), config=cfg)
    except (ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_raises_on_every_rank(case):
    stage, zenflow, needle = BAD[case]
    messages = run_distributed(bad_config, 2, args=(stage, zenflow), timeout=60)
    assert all(needle in m and m != "no error" for m in messages), messages
    assert len(set(messages)) == 1, messages


def test_zenflow_needs_offload_and_adam():
    from deepspeed.runtime.zenflow.device_part import check_adam
    from deepspeed.runtime.zenflow.config import check_zenflow_stage, parse_zenflow
    with pytest.raises(ValueError, match="offload_optimizer"):
        check_zenflow_stage(parse_zenflow({}), 2, "none")
    with pytest.raises(ValueError, match="Adam"):
        check_adam(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
