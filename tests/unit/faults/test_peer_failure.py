# SPDX-License-Identifier: Apache-2.0
"""A rank that leaves a step through an exception, on 2 gloo ranks (``deepspeed/comm/peer_failure.py``).

* the retry case: rank 1 raises inside forward at step 3, catches it, calls ``destroy()`` and starts a new
  ``initialize``; rank 0 is in the step's gradient all-reduce. Rank 0 gets :class:`PeerFailureError` naming
  rank 1 and its exception within the configured wait (plus slack), not the group's 30 minutes; rank 1's retry
  and rank 0's get a clear error at once, no rendezvous wait;
* every rank raising at the same point (a bad input every rank rejects) stays what it was: each rank gets its own
  exception, the group stays usable, training goes on and matches plain torch;
* the wait honours ``set_failure_timeout``, ``DS_PEER_FAILURE_TIMEOUT`` and half the group's timeout
  (``init_distributed(timeout=...)``); ``DEEPSPEED_TIMEOUT`` (minutes) sets the default group timeout.

Every multi-rank call runs under a hard timeout; a hang fails the test instead of blocking the suite.
"""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.unit.common import run_distributed
from tests.unit.harness import get_pool

WAIT_S = 3.0
HARD_TIMEOUT_S = 120


class Flaky(nn.Module):
    """An MLP whose forward raises on ``fail_rank`` at ``fail_step`` (``fail_rank`` None: never; -1: every rank)."""

    def __init__(self, fail_rank=None, fail_step=None):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 2)
        self.fail_rank, self.fail_step, self.step = fail_rank, fail_step, 0

    def forward(self, x):
        import deepspeed.comm as dist
        if self.step == self.fail_step and self.fail_rank in (-1, dist.get_rank()):
            raise ValueError(f"bad batch at step {self.step}")
        return self.fc2(torch.tanh(self.fc1(x)))


def config(stage):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "steps_per_print": float("inf"),
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "zero_optimization": {
            "stage": stage
        },
    }


def batch(rank, step):
    gen = torch.Generator().manual_seed(97 * rank + step)
    return torch.randn(2, 4, generator=gen), torch.randn(2, 2, generator=gen)


def run_fault(fn, *args):
    """Run a case that aborts the pool's process group, then restart the pool: a group formed again in the same
    processes would meet the old gloo addresses in the (multi-tenant) rendezvous store."""
    try:
        return run_distributed(fn, 2, args=args, timeout=HARD_TIMEOUT_S)
    finally:
        get_pool(2).kill()


def rank_fails_in_forward(stage):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.comm import PeerFailureError
    rank = dist.get_rank()
    dist.set_failure_timeout(WAIT_S)
    torch.manual_seed(0)
    model = Flaky(fail_rank=1, fail_step=3)
    engine = deepspeed.initialize(model=model, config=config(stage))[0]
    out = {}
    try:
        for step in range(6):
            model.step = step
            x, y = batch(rank, step)
            if rank == 1:
                try:
                    loss = F.mse_loss(engine(x), y)
                except ValueError as exc:
                    out["own"] = str(exc)
                    engine.destroy()
                    started = time.monotonic()
                    try:
                        deepspeed.initialize(model=Flaky(), config=config(stage))
                    except PeerFailureError as retry:
                        out["retry"] = str(retry)
                        out["retry_s"] = time.monotonic() - started
                    return out
                engine.backward(loss)
                engine.step()
            else:
                loss = F.mse_loss(engine(x), y)
                started = time.monotonic()
                try:
                    engine.backward(loss)  # stage 0 and 2: the gradient all-reduce runs in this backward
                    engine.step()
                except PeerFailureError as exc:
                    out["error"] = str(exc)
                    out["failed"] = exc.failed
                    out["waited_s"] = time.monotonic() - started
                    out["step"] = step
                    started = time.monotonic()
                    try:
                        deepspeed.initialize(model=Flaky(), config=config(stage))
                    except PeerFailureError as retry:
                        out["retry"] = str(retry)
                        out["retry_s"] = time.monotonic() - started
                    return out
        out["finished"] = True
        return out
    finally:
        dist.set_failure_timeout(None)


@pytest.mark.parametrize("stage", [0, 2])
def test_peer_fails_with_the_failed_ranks_reason(stage):
    first, second = run_fault(rank_fails_in_forward, stage)
    assert "finished" not in first, first
    assert first["step"] == 3, first
    assert set(first["failed"]) == {1}, first
    for needle in ("rank 1", "engine.forward", "ValueError: bad batch at step 3"):
        assert needle in first["error"], first["error"]
    # the wait is WAIT_S; slack for a loaded machine, far below the group's 30 minutes
    assert first["waited_s"] < WAIT_S + 45, first["waited_s"]
    assert second["own"] == "bad batch at step 3", second
    for out in (first, second):
        assert "rank 1 left engine.forward" in out["retry"] and "restart the job" in out["retry"], out["retry"]
        assert out["retry_s"] < 10, out["retry_s"]


def every_rank_rejects_the_same_batch():
    import deepspeed
    import deepspeed.comm as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.set_failure_timeout(60.0)  # the symmetric case must not wait for it
    torch.manual_seed(0)
    model = Flaky(fail_rank=-1, fail_step=1)
    reference = Flaky()
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    engine = deepspeed.initialize(model=model, config=config(2))[0]
    raised, seconds = [], 0.0
    try:
        for step in range(4):
            model.step = step
            x, y = batch(rank, step)
            started = time.monotonic()
            try:
                loss = F.mse_loss(engine(x), y)
            except ValueError as exc:
                seconds = time.monotonic() - started
                raised.append(str(exc))
                continue
            engine.backward(loss)
            engine.step()
            ref_opt.zero_grad()
            for r in range(world):
                xr, yr = batch(r, step)
                (F.mse_loss(reference(xr), yr) / world).backward()
            ref_opt.step()
        for (name, p), q in zip(engine.module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
        flag = torch.ones(1)
        dist.all_reduce(flag)
        assert float(flag) == world
    finally:
        engine.destroy()
        dist.set_failure_timeout(None)
    return raised, seconds


def test_every_rank_raising_alike_keeps_training():
    results = run_distributed(every_rank_rejects_the_same_batch, 2, timeout=HARD_TIMEOUT_S)
    for raised, seconds in results:
        assert raised == ["bad batch at step 1"], raised
        assert seconds < 30, seconds  # not the 60 s wait: every rank reported at once


def wait_settings():
    import deepspeed.comm as dist
    from deepspeed.comm.peer_failure import failure_timeout
    out = {"default": failure_timeout()}
    dist.set_failure_timeout(5)
    out["set"] = failure_timeout()
    dist.set_failure_timeout(None)
    os.environ["DS_PEER_FAILURE_TIMEOUT"] = "7.5"
    out["env"] = failure_timeout()
    del os.environ["DS_PEER_FAILURE_TIMEOUT"]
    return out


def test_wait_settings():
    (out, ) = run_distributed(wait_settings, 1, timeout=60)
    assert out == {"default": 60.0, "set": 5.0, "env": 7.5}, out  # the harness group's timeout is 30 minutes


LONE = """
import os, sys
from datetime import timedelta
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed.comm as dist
from deepspeed.comm.peer_failure import failure_timeout
print("default", dist.DEFAULT_PG_TIMEOUT.total_seconds())
dist.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=20), verbose=False)
print("wait", failure_timeout())
"""


def test_group_timeouts_are_honoured():
    """``DEEPSPEED_TIMEOUT`` (minutes) is the default group timeout; ``init_distributed(timeout=...)`` caps the
    wait at half of it (in a process of its own: the pool's group exists already)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = dict(os.environ,
               DEEPSPEED_TIMEOUT="7",
               PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", LONE, port], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split() for line in done.stdout.splitlines() if line.split()[0] in ("default", "wait"))
    assert float(lines["default"]) == 7 * 60, done.stdout
    assert float(lines["wait"]) == 10.0, done.stdout
