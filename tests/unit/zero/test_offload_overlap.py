# SPDX-License-Identifier: Apache-2.0
"""The pipelined offloaded step against the plain one: same bits for masters, moments and losses.

The plain path (``DS_OFFLOAD_OVERLAP=0``) steps each whole partition with ``DeepSpeedCPUAdam``, scales the
gradient in a pass of its own for clipping and uploads afterwards. The pipelined path steps bucket by
bucket in forward order on the host Adam op, applies the clipping coefficient as the op reads the
gradient, uploads each bucket as soon as it is stepped and, on one rank, lets the next forward run while
the host steps the last buckets. Every piece is slowed on purpose (``StepPipeline.piece_delay``), so a
forward that did not wait for its own piece would read stale weights and the losses would differ.
"""

import copy
import os

import pytest
import torch

import deepspeed
from deepspeed.ops.adam import host_adam
from deepspeed.runtime.zero.offload.step_pipeline import StepPipeline
from tests.unit.common import run_distributed

pytestmark = pytest.mark.skipif(host_adam.host_adam_op() is None, reason="the host Adam op cannot be built here")


class _Net(torch.nn.Module):

    def __init__(self, width, depth):
        super().__init__()
        self.embed = torch.nn.Linear(7, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.odd = torch.nn.Linear(width, 1)  # a 1-wide layer
        self.head = torch.nn.Linear(1, 3)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(self.odd(x))


def _train(overlap, stage, clip, steps, delay, width, depth, bucket, gas, bf16=False, ratio=1.0, peek=False):
    os.environ["DS_OFFLOAD_OVERLAP"] = "1" if overlap else "0"
    StepPipeline.piece_delay = delay
    try:
        torch.manual_seed(7)
        model = _Net(width, depth)
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": gas,
            "gradient_clipping": clip,
            "bf16": {
                "enabled": bf16
            },
            "optimizer": {
                "type": "AdamW",
                "params": {
                    "lr": 3e-2,
                    "weight_decay": 0.1
                }
            },
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": bucket,
                "offload_optimizer": {
                    "device": "cpu",
                    "ratio": ratio
                }
            },
        }
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
        stage_obj = engine._stage
        assert (stage_obj.host_step.share is not None) == (ratio < 1.0)
        assert (stage_obj.host_step.pipeline is not None) == (overlap and bf16)  # fp32: torch's kernels, plain
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        gen = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(steps * gas):
            x = torch.randn(2, 7, generator=gen).to(torch.bfloat16 if bf16 else torch.float32)
            y = torch.randn(2, 3, generator=gen)
            loss = torch.nn.functional.mse_loss(engine(x).float(), y) * 50.0  # large gradients: clipping is active
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if peek:  # an accessor between steps: the device share's values come down and go up again
                from deepspeed.utils import safe_get_full_fp32_param
                safe_get_full_fp32_param(model.embed.weight)
        stage_obj._masters_current()  # the last step may still run in the background: wait for it
        params = [p.detach().clone() for p in model.parameters()]
        masters = [m.detach().clone() for m in stage_obj.masters]
        moments = []
        for master in stage_obj.masters:
            state = stage_obj.optimizer.state.get(master, {})
            moments += [state[k].clone() for k in ("exp_avg", "exp_avg_sq") if k in state]
            if "step" in state:
                moments.append(torch.as_tensor(float(state["step"])))
        engine.destroy()
        return losses, params, masters, moments
    finally:
        StepPipeline.piece_delay = 0.0
        os.environ.pop("DS_OFFLOAD_OVERLAP", None)


def _compare(stage, clip, steps, delay, width, depth, bucket, gas, bf16=False):
    """Train with and without overlap on this rank; return whether every number is bit-identical."""
    plain = _train(False, stage, clip, steps, 0.0, width, depth, bucket, gas, bf16)
    overlapped = _train(True, stage, clip, steps, delay, width, depth, bucket, gas, bf16)
    assert plain[0] == overlapped[0], f"losses differ: {plain[0]} vs {overlapped[0]}"
    for name, a_list, b_list in zip(("params", "masters", "moments"), plain[1:], overlapped[1:]):
        assert len(a_list) == len(b_list), name
        for a, b in zip(a_list, b_list):
            assert torch.equal(a, b), f"{name} differ"
    assert plain[0][0] != plain[0][-1]  # it trained
    return True


@pytest.mark.parametrize("stage,clip,gas,bf16", [(2, 1.0, 2, True), (1, 0.5, 1, True), (2, 0.0, 1, True),
                                                 (3, 1.0, 2, True), (2, 1.0, 1, False)])
def test_overlap_is_bit_identical_world1(stage, clip, gas, bf16):
    # small buckets: many pieces; the delay makes the forward overtake the host step unless it waits
    assert run_distributed(_compare, 1, args=(stage, clip, 3, 0.01, 9, 4, 40, gas, bf16), timeout=180) == [True]


def test_overlap_is_bit_identical_world2():
    assert run_distributed(_compare, 2, args=(2, 1.0, 3, 0.005, 5, 3, 17, 2, True), timeout=180) == [True, True]


def _compare_ratio(ratio, steps, width, depth, gas):
    full = _train(True, 3, 1.0, steps, 0.0, width, depth, 40, gas, True)
    partial = _train(True, 3, 1.0, steps, 0.0, width, depth, 40, gas, True, ratio=ratio, peek=True)
    assert full[0] == partial[0], f"losses differ: {full[0]} vs {partial[0]}"
    for name, a_list, b_list in zip(("params", "masters", "moments"), full[1:], partial[1:]):
        for a, b in zip(a_list, b_list):
            assert torch.equal(a, b), f"{name} differ"
    return True


@pytest.mark.parametrize("ratio", [0.0, 0.37])
def test_partial_offload_equals_full_offload_world1(ratio):
    assert run_distributed(_compare_ratio, 1, args=(ratio, 3, 9, 3, 2), timeout=180) == [True]


def test_partial_offload_equals_full_offload_world2():
    assert run_distributed(_compare_ratio, 2, args=(0.5, 3, 5, 2, 1), timeout=180) == [True, True]


def test_overlap_state_dict_waits_for_the_step():
    assert run_distributed(_state_dict_waits, 1, timeout=120) == [True]


def _small_bucket_config():
    """ZeRO-2, bf16, the optimizer offloaded, buckets of 20 elements (so a small net has several pieces)."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {
            "enabled": True
        },
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-1
            }
        },
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": 20,
            "offload_optimizer": {
                "device": "cpu"
            }
        },
    }


def _state_dict_waits():
    os.environ["DS_OFFLOAD_OVERLAP"] = "1"
    StepPipeline.piece_delay = 0.02
    try:
        torch.manual_seed(3)
        model = _Net(6, 3)
        config = _small_bucket_config()
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
        loss = engine(torch.randn(2, 7, dtype=torch.bfloat16)).float().square().mean()
        engine.backward(loss)
        engine.step()
        assert engine._stage.host_step.pipeline.pending  # the step still runs in the background
        weights = {k: v.clone() for k, v in model.state_dict().items()}  # waits for every piece
        assert not engine._stage.host_step.pipeline.pending
        engine._stage._masters_current()
        for name, p in model.named_parameters():
            assert torch.equal(weights[name], p.detach())
        engine.destroy()
        return True
    finally:
        StepPipeline.piece_delay = 0.0
        os.environ.pop("DS_OFFLOAD_OVERLAP", None)


READERS = {
    # how user code reads parameters between engine.step() and the next forward (an EMA, a log of norms)
    "parameters":
    lambda model: [p.detach().clone() for p in model.parameters()],
    "named_parameters":
    lambda model: [p.detach().clone() for _, p in model.named_parameters()],
    "attribute":
    lambda model: [model.head.weight.detach().clone(),
                   model.head.bias.detach().clone()],
    "a sibling's weight":
    lambda model: [torch.nn.functional.linear(torch.ones(1, 1, dtype=torch.bfloat16), model.head.weight)],
    "deepcopy":
    lambda model: [p.detach().clone() for p in copy.deepcopy(model).parameters()],
}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_reads_through_the_module_wait_for_the_step(reader):
    assert run_distributed(_reads_wait, 1, args=(reader, ), timeout=120) == [True]


def _reads_wait(reader):
    """A parameter read through its module while the step still runs sees the stepped value: the same as the
    whole-partition step's (DS_OFFLOAD_OVERLAP=0) read at the same point."""
    seen = {}
    for overlap in ("0", "1"):
        os.environ["DS_OFFLOAD_OVERLAP"] = overlap
        StepPipeline.piece_delay = 0.02 if overlap == "1" else 0.0
        try:
            torch.manual_seed(3)
            model = _Net(6, 3)
            config = _small_bucket_config()
            engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
            gen = torch.Generator().manual_seed(5)
            reads = []
            for _ in range(2):
                loss = engine(torch.randn(2, 7, generator=gen, dtype=torch.bfloat16)).float().square().mean()
                engine.backward(loss)
                engine.step()
                if overlap == "1":
                    assert engine._stage.host_step.pipeline.pending  # the step still runs in the background
                reads.append(READERS[reader](model))
            seen[overlap] = reads
            engine.destroy()
        finally:
            StepPipeline.piece_delay = 0.0
            os.environ.pop("DS_OFFLOAD_OVERLAP", None)
    for step, (got, want) in enumerate(zip(seen["1"], seen["0"])):
        assert len(got) == len(want) and got
        for a, b in zip(got, want):
            assert torch.equal(a, b), f"step {step}: a read while the step runs differs from the stepped value"
    return True


def test_host_adam_pieces_match_one_call():
    op = host_adam.host_adam_op()
    gen = torch.Generator().manual_seed(0)
    n = 100_003
    group = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "decoupled_weight_decay": True}
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    results = []
    for split in ([n], [1, 7, 40_000, 59_995]):
        p = p0.clone()
        state = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
        out = torch.empty(n, dtype=torch.bfloat16)
        for _ in range(2):
            scalars = host_adam.begin_step(group, p, state)
            start = 0
            for length in reversed(split):  # any order
                host_adam.step_piece(op, group, scalars, p, g, state, n - start - length, length, out, 0.37)
                start += length
        results.append((p, state["exp_avg"], state["exp_avg_sq"], out))
    scaled = p0.clone()
    state = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
    for _ in range(2):
        host_adam.adam_step(op, group, scaled, g * 0.37, state)  # a separate clipping pass, then the step
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b)
    assert torch.equal(results[0][0], scaled) and torch.equal(results[0][1], state["exp_avg"])
