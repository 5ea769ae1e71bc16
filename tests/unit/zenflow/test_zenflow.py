# SPDX-License-Identifier: Apache-2.0
"""ZenFlow against a plain-torch model of its algorithm (``reference.py``), on gloo ranks.

* the algorithm: ZeRO 1/2 with CPU offload, worlds 1 and 2 (partitions cut rows there), with
  and without ``overlap_step``, fixed and "auto" update intervals, warm-up, clipping, bf16:
  after every step the model's parameters equal the reference's, and at the end the fp32
  values (``safe_get_full_fp32_param``) too. The reference computes its own gradients;
* fp16: the reference steps the engine's reduced gradients (read at each boundary), so the
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
    """Weights of several row counts (an embedding, two linears) and biases (always on the device)."""

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
    update = zenflow.get("update_interval", "auto")
    select = zenflow.get("select_interval", "auto")
    return ZenFlowReference({
        n: p
        for n, p in model.named_parameters()
    },
                            lr=LR,
                            weight_decay=0.01,
                            clip=CLIP,
                            topk=zenflow.get("topk_ratio", 0.1),
                            update_every=None if update == "auto" else update,
                            select_every=None if select == "auto" else select,
                            warm_up=zenflow.get("full_warm_up_rounds", 0),
                            overlap=zenflow.get("overlap_step", False),
                            auto_ratio=zenflow.get("auto_ratio", 0.99),
                            window_update=zenflow.get("window_update", "once"),
                            apply_after=zenflow.get("overlap_apply_after", "window"))


def reference_grads(model, values, world, gas, step):
    """The window's mean gradient over every rank's micro-batches, at ``values`` (plain torch, fp32)."""
    probe = copy.deepcopy(model).float()
    with torch.no_grad():
        for n, p in probe.named_parameters():
            p.copy_(values[n])
    probe.zero_grad(set_to_none=True)
    for r in range(world):
        for m in range(gas):
            (loss_of(probe, *batch(r, step, m)) / gas).backward()
    return {n: p.grad / world for n, p in probe.named_parameters()}


def train(engine, rank, steps, gas, first_step=0, on_boundary=None):
    for step in range(first_step, first_step + steps):
        for m in range(gas):
            engine.backward(loss_of(engine, *batch(rank, step, m)))
            if m == gas - 1 and on_boundary is not None:
                on_boundary(step)
            engine.step()


def slow_host_worker():
    """Make every accumulation start late on the host worker, so the next backward runs while it still has to read
    its partitions (they must be the other set by then)."""
    import time
    from deepspeed.runtime.zenflow.host_window import HostWindow
    original = HostWindow.accumulate

    def accumulate(self, parts, coef):
        self.worker.submit(lambda: time.sleep(0.05))
        return original(self, parts, coef)

    HostWindow.accumulate = accumulate
    return lambda: setattr(HostWindow, "accumulate", original)


def run_against_reference(stage, gas, zenflow, dtype, steps, slow_worker=False):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param
    rank, world = dist.get_rank(), dist.get_world_size()
    restore = slow_host_worker() if slow_worker else (lambda: None)
    torch.manual_seed(0)
    model = ZFNet()
    ref = reference_for(model, zenflow)
    engine = deepspeed.initialize(model=copy.deepcopy(model), config=config(stage, gas, zenflow, dtype))[0]
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "fp32" else dict(rtol=1e-2, atol=1e-2)
    checked = 0
    try:
        for step in range(steps):
            grads = reference_grads(model, ref.Q, world, gas, step)
            train(engine, rank, 1, gas, first_step=step)
            ref.step(grads)
            for name, p in engine.module.named_parameters():
                torch.testing.assert_close(p.detach().float(),
                                           ref.Q[name],
                                           **tol,
                                           msg=lambda m: f"step {step} {name}: {m}")
                checked += 1
        expected = ref.fp32_values()
        for name, p in engine.module.named_parameters():
            torch.testing.assert_close(safe_get_full_fp32_param(p), expected[name], **tol)
    finally:
        engine.destroy()
        restore()
    return checked


CASES = {
    "z2-w1":
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
    "z2-w2-overlap":
    dict(stage=2,
         world=2,
         gas=2,
         zenflow=dict(topk_ratio=0.3, update_interval=2, select_strategy="step", select_interval=2,
                      overlap_step=True)),
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
         gas=2,
         dtype="bf16",
         zenflow=dict(topk_ratio=0.3, update_interval=2, select_strategy="step", select_interval=4, offload=True)),
    "z2-w1-all-rows":
    dict(stage=2,
         world=1,
         gas=1,
         zenflow=dict(topk_ratio=1.0, update_interval=2, select_strategy="step", select_interval=2)),
    # the window update and the overlapped host step's apply point: a window of 4 (applied 2 steps after its
    # launch, mid-window), "repeat", and upstream's arithmetic ("once", applied when the next window closes)
    "z2-w2-overlap-apply2":
    dict(stage=2,
         world=2,
         gas=1,
         zenflow=dict(topk_ratio=0.3, update_interval=4, select_strategy="step", select_interval=8,
                      overlap_step=True)),
    "z1-w2-repeat-apply1":
    dict(stage=1,
         world=2,
         gas=2,
         zenflow=dict(topk_ratio=0.2,
                      update_interval=3,
                      select_strategy="step",
                      select_interval=6,
                      overlap_step=True,
                      overlap_apply_after=1,
                      window_update="repeat")),
    "z2-w1-repeat":
    dict(stage=2,
         world=1,
         gas=1,
         zenflow=dict(topk_ratio=0.25,
                      update_interval=3,
                      select_strategy="step",
                      select_interval=3,
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
         gas=2,
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
         gas=2,
         slow_worker=True,
         zenflow=dict(topk_ratio=0.3, update_interval=2, select_strategy="step", select_interval=4,
                      overlap_step=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_zenflow_matches_reference(case):
    c = CASES[case]
    checked = run_distributed(run_against_reference,
                              c["world"],
                              args=(c["stage"], c["gas"], c["zenflow"], c.get("dtype",
                                                                              "fp32"), 9, c.get("slow_worker", False)),
                              timeout=120)
    assert all(n == 9 * 5 for n in checked), checked  # 9 steps x 5 parameters


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
    engine = deepspeed.initialize(model=copy.deepcopy(model), config=config(2, 2, zenflow, "fp16"))[0]
    skipped_ok = []
    try:
        for step in range(7):
            before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
            scale_before = engine.get_loss_scale()
            grads = {}

            def boundary(s):
                grads.update({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()})

            for m in range(2):
                loss = loss_of(engine, *batch(rank, step, m))
                if step == overflow_step and m == 1 and rank == world - 1:
                    loss = loss * float("inf")  # only the last rank overflows
                engine.backward(loss)
                if m == 1:
                    boundary(step)
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
        assert engine._stage.zenflow.steps == 6  # the skipped step did not count
    finally:
        engine.destroy()
    return skipped_ok


def test_fp16_overflow_skips_both_parts_on_every_rank():
    assert run_distributed(fp16_overflow_skip, 2, args=(3, ), timeout=120) == [[3], [3]]


# ----------------------------------------------------------------- checkpoints
def resume_mid_window(save_dir, total, cut):
    import deepspeed
    import deepspeed.comm as dist
    rank = dist.get_rank()
    # windows of 3 steps, a selection every 6: after 4 steps, one step of the second window is accumulated and
    # the first window's host step is done but not applied yet
    zenflow = dict(topk_ratio=0.3, update_interval=3, select_strategy="step", select_interval=6, overlap_step=True)
    cfg = config(2, 2, zenflow)
    torch.manual_seed(0)
    model = ZFNet()
    straight = deepspeed.initialize(model=copy.deepcopy(model), config=cfg)[0]
    train(straight, rank, total, 2)
    expected = {n: p.detach().clone() for n, p in straight.module.named_parameters()}
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
    for n, p in second.module.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], rtol=1e-6, atol=1e-7)
    second.destroy()
    return True


def test_save_load_mid_window_resumes_exactly(tmp_path):
    assert run_distributed(resume_mid_window, 2, args=(str(tmp_path), 9, 4), timeout=120) == [True, True]


# ----------------------------------------------------------------- bad configs
BAD = {
    "topk_zero": (2, dict(topk_ratio=0.0), "topk_ratio"),
    "topk_above_one": (2, dict(topk_ratio=1.5), "topk_ratio"),
    "interval_without_strategy": (2, dict(select_interval=4), "select_strategy"),
    "strategy_without_interval": (2, dict(select_strategy="step"), "select_interval"),
    "stage3": (3, dict(topk_ratio=0.1), "stage 3"),
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
