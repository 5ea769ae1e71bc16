# SPDX-License-Identifier: Apache-2.0
"""Resharding: a ZeRO checkpoint saved on W ranks loads on W' ranks, into another stage or bucket layout.

Every rank of every world size trains on its equal share of one fixed global batch, so
the trained model does not depend on the world size (up to rounding). Each cell:

* saves after 3 steps on W ranks (stage ``s``), and goes on for 3 more steps without
  resharding (the run that never resharded);
* loads on W' ranks (stage ``s'``): right after the load, every fp32 parameter, model
  parameter and optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``) equals the
  saved one bitwise (resharding only moves numbers);
* trains 3 more steps: fp32 matches a plain-torch AdamW reference of all 6 steps and
  the never-resharded run (tight tolerance); bf16 matches the never-resharded run.
"""

import pytest
import torch

from tests.unit.checkpoint import test_checkpoint_resume as common
from tests.unit.common import run_distributed

GLOBAL_BATCH = 6  # divisible by every world size used here
SEQ = 3
FP32_TOL = dict(rtol=2e-5, atol=2e-6)
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def global_batch(step):
    from tests.unit.contract.models import VOCAB
    gen = torch.Generator().manual_seed(5000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    return tokens, targets


def shard_fn(rank, world):
    rows = GLOBAL_BATCH // world

    def batch(step, micro):
        tokens, targets = global_batch(step)
        return tokens[rank * rows:(rank + 1) * rows], targets[rank * rows:(rank + 1) * rows]

    return batch


def config(stage, dtype, world, bucket):
    return common.make_config(stage, dtype, gas=1, micro=GLOBAL_BATCH // world, bucket=bucket, scheduler=False)


def save_worker(tmp, stage, dtype, bucket):
    import deepspeed.comm as dist
    common.attach_checkpointing()
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = common.build_engine(config(stage, dtype, world, bucket), seed=0)
    batch = shard_fn(rank, world)
    common.train(engine, 3, 0, rank, batch_fn=batch)
    engine.save_checkpoint(tmp)
    at_save = common.snapshot(engine)
    common.train(engine, 3, 3, rank, batch_fn=batch)
    final = common.snapshot(engine)
    engine.destroy()
    return at_save, final


def reference_params(steps):
    """Plain torch: AdamW on the global batch, gradient clipping at 1.0 (the engine's formula)."""
    from tests.unit.contract.models import lm_loss
    model = common.build_model(0)
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=common.LR, weight_decay=0.01, foreach=False)
    for step in range(steps):
        tokens, targets = global_batch(step)
        opt.zero_grad()
        lm_loss(model(tokens), targets).backward()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        coef = min(1.0, 1.0 / (float(norm) + 1e-6))
        for p in params:
            p.grad.mul_(coef)
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def load_worker(tmp, stage, dtype, bucket, at_save, final):
    import deepspeed.comm as dist
    common.attach_checkpointing()
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = common.build_engine(config(stage, dtype, world, bucket), seed=1)
    path, _ = engine.load_checkpoint(tmp)
    assert path is not None
    loaded = common.snapshot(engine)
    bad = common.differences(at_save, loaded)
    assert not bad, f"rank {rank}: state right after the resharded load differs from the saved state: {bad}"
    common.train(engine, 3, 3, rank, batch_fn=shard_fn(rank, world))
    after = common.snapshot(engine)
    engine.destroy()
    check_continuation(after, final, reference_params(6) if dtype == "fp32" else None, dtype, rank,
                       "the never-resharded run")
    return True


def check_continuation(after, final, expected, dtype, rank, what):
    """The fp32 parameters after the loaded engine's extra steps equal ``final`` (``what``: the run they came from)
    and, where given, ``expected`` (plain torch's after the same steps, by parameter name)."""
    tol = FP32_TOL if dtype == "fp32" else BF16_TOL
    for name in (n for n in after if n.startswith("fp32/")):
        torch.testing.assert_close(after[name],
                                   final[name],
                                   **tol,
                                   msg=lambda m, name=name: f"rank {rank}: {name} vs {what}: {m}")
        if expected is not None:
            torch.testing.assert_close(after[name],
                                       expected[name[len("fp32/"):]],
                                       **FP32_TOL,
                                       msg=lambda m, name=name: f"rank {rank}: {name} vs plain torch: {m}")


CELLS = [
    # (save world, save stage, load world, load stage, dtype, save bucket, load bucket)
    (2, 1, 1, 1, "fp32", 40, 40),
    (2, 2, 3, 2, "fp32", 40, 40),
    (3, 2, 2, 2, "fp32", 40, 40),
    (3, 1, 2, 2, "fp32", 40, 40),
    (2, 1, 2, 2, "fp32", 40, 40),  # same layout: each rank reads only its own file
    (2, 2, 2, 1, "bf16", 40, 40),
    (2, 2, 2, 2, "fp32", 40, 1000),  # same world, other buckets
    (2, 2, 1, 0, "fp32", 40, 40),
    (2, 0, 3, 2, "bf16", 40, 40),
    (2, 1, 3, 1, "bf16", 40, 40),
]


@pytest.mark.parametrize("cell", CELLS, ids=[f"w{c[0]}z{c[1]}-to-w{c[2]}z{c[3]}-{c[4]}-b{c[5]}-{c[6]}" for c in CELLS])
def test_reshard(tmp_path, cell):
    save_world, save_stage, load_world, load_stage, dtype, save_bucket, load_bucket = cell
    tmp = str(tmp_path)
    at_save, final = run_distributed(save_worker, save_world, args=(tmp, save_stage, dtype, save_bucket),
                                     timeout=120)[0]
    results = run_distributed(load_worker,
                              load_world,
                              args=(tmp, load_stage, dtype, load_bucket, at_save, final),
                              timeout=120)
    assert results == [True] * load_world
