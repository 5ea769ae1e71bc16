# SPDX-License-Identifier: Apache-2.0
"""``seq_parallel_communication_data_type``: with sequence parallelism the gradients are reduced in that dtype.

Upstream's engine takes it as its ``communication_data_type`` when ``sequence_parallel_size > 1`` (fp32 unless set,
whatever ``communication_data_type`` says). World 2 with ``sequence_parallel_size`` 2: each rank backpropagates
its own loss, the two gradients are summed over the sequence-data group and divided by dp x sp = 2. The reference
is plain torch: the mean of the two ranks' fp32 gradients, and the same sum with each addend and the sum rounded to
bf16 (what a bf16 reduction of two addends computes). A bf16 reduction must give the second to bf16 precision and
differ from the first; the default (fp32) must give the first.
"""

import pytest
import torch

from tests.unit.common import run_distributed

IN, HIDDEN, OUT = 7, 5, 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def _batch(rank):
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(4, IN, generator=generator), torch.randn(4, OUT, generator=generator)


def _loss(model, rank):
    x, y = _batch(rank)
    return ((model(x) - y)**2).mean()


def _reference():
    """Per parameter: (fp32 mean of the two ranks' gradients, the same through a bf16 sum of two addends)."""
    grads = []
    for rank in range(2):
        model = _model()
        _loss(model, rank).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    exact = [(a + b) / 2 for a, b in zip(*grads)]
    bf16 = [(a.bfloat16() + b.bfloat16()).float() / 2 for a, b in zip(*grads)]
    return exact, bf16


def _worker(stage, seq_dtype):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_grad

    rank = dist.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "sequence_parallel_size": 2,
        "zero_optimization": {
            "stage": stage
        },
        "communication_data_type": "fp16",  # overridden by the sequence-parallel key, as upstream's engine does
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
    }
    if seq_dtype is not None:
        config["seq_parallel_communication_data_type"] = seq_dtype
    engine, *_ = deepspeed.initialize(model=_model(), config=config)
    assert engine.communication_data_type == (torch.bfloat16 if seq_dtype == "bf16" else torch.float32)
    engine.backward(_loss(engine.module, rank))
    grads = [safe_get_full_grad(p).float().clone() for p in engine.module.parameters()]
    engine.step()
    return grads


@pytest.mark.parametrize("stage", [0, 2])
def test_seq_parallel_comm_dtype_is_the_reduction_dtype(stage):
    exact, bf16 = _reference()
    for seq_dtype in (None, "bf16"):
        results = run_distributed(_worker, 2, args=(stage, seq_dtype), timeout=120)
        for grads in results:
            for got, want_exact, want_bf16 in zip(grads, exact, bf16):
                if seq_dtype is None:
                    torch.testing.assert_close(got, want_exact, rtol=1e-6, atol=1e-7)
                else:
                    torch.testing.assert_close(got, want_bf16, rtol=1e-2, atol=1e-3)
            if seq_dtype == "bf16":
                assert any(not torch.equal(g, e) for g, e in zip(grads, exact)), "the reduction was not in bf16"
