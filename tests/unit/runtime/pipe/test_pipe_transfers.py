# SPDX-License-Identifier: Apache-2.0
"""Transfers between stages: tuples mixing float, int and bool tensors and a float computed from parameters, at
3 stages over several steps (upstream's shared receive buffer aborts there at step 2), sequence lengths that change
between micro-batches with ``dynamic_shape``, and ``eval_batch`` leaving the parameters untouched. Every step is
checked against plain torch on the whole batch."""

import torch

from tests.unit.common import run_distributed

D = 4


class Embed(torch.nn.Module):
    """x [mb, T, D] -> (h float, lengths int64, v float [2, D] from a parameter, mask bool [mb, T])."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(D, D)
        self.v = torch.nn.Parameter(torch.randn(2, D))

    def forward(self, x):
        mask = x[..., 0] > -0.5
        lengths = mask.sum(dim=1).clamp(min=1).to(torch.int64)
        return self.proj(x), lengths, self.v * 1.0, mask


class Mix(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(D, D)

    def forward(self, inputs):
        h, lengths, v, mask = inputs
        h = torch.tanh(self.proj(h) + v[0]) * mask.unsqueeze(-1)
        return h, lengths, v * v, mask


class Pool(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(D, 2)

    def forward(self, inputs):
        h, lengths, v, mask = inputs
        pooled = h.sum(dim=1) / lengths.unsqueeze(-1).to(h.dtype)
        return self.out(pooled + v[1])


def _loss(out, labels):
    return torch.nn.functional.mse_loss(out, labels)


def _data(step, micro_batch, gas, lengths):
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for i in range(gas):
        t = lengths[(step * gas + i) % len(lengths)]
        out.append((torch.randn(micro_batch, t, D, generator=g), torch.randn(micro_batch, 2, generator=g)))
    return out


def _mixed_tuples(lengths, steps):
    import copy
    import deepspeed
    from deepspeed.pipe import PipelineModule
    torch.manual_seed(0)
    layers = [Embed(), Mix(), Mix(), Pool()]
    reference = torch.nn.Sequential(*copy.deepcopy(layers))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model = PipelineModule(layers, num_stages=3, loss_fn=_loss, partition_method="uniform", dynamic_shape=True)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "steps_per_print": 10**6,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "zero_optimization": {
            "stage": 1
        }
    }
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    worst = 0.0
    for step in range(steps):
        batch = _data(step, 2, 4, lengths)
        loss = float(engine.train_batch(iter(batch)))
        opt.zero_grad()
        expected = 0.0
        for x, y in batch:
            micro = _loss(reference(x), y) / len(batch)
            micro.backward()
            expected += float(micro)
        opt.step()
        worst = max(worst, abs(loss - expected))
    for name, p in engine.module.named_parameters():
        index, attr = name.split(".", 1)
        want = dict(reference[int(index)].named_parameters())[attr]
        worst = max(worst, float((p - want).abs().max()))
    # eval_batch: the mean loss on every stage, the last stage's outputs, and no parameter moves
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    batch = _data(9, 2, 4, lengths)
    result, logits = engine.eval_batch(iter(batch), return_logits=True)
    with torch.no_grad():
        expected = sum(float(_loss(reference(x), y)) for x, y in batch) / len(batch)
        last = reference(batch[-1][0])
    moved = max(float((p - before[n]).abs().max()) for n, p in engine.module.named_parameters())
    logits_err = float((logits - last).abs().max()) if engine.is_last_stage() else 0.0
    engine.destroy()
    return worst, abs(float(result) - expected), moved, logits_err


def test_mixed_dtype_tuples_and_changing_lengths_at_three_stages():
    results = run_distributed(_mixed_tuples, 3, args=([3, 5, 2, 4, 1], 3))
    for rank, (worst, eval_err, moved, logits_err) in enumerate(results):
        assert worst < 1e-5, (rank, results)
        assert eval_err < 1e-5 and moved == 0.0 and logits_err < 1e-6, (rank, results)
