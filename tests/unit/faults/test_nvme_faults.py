# SPDX-License-Identifier: Apache-2.0
"""NVMe offload's bad input and faults: clear errors on every rank, nothing hangs, nothing silently wrong.

* ``device: nvme`` without ``nvme_path``; a path that does not exist, is not a folder, or that one rank cannot use
  (every rank raises before the first collective); a folder another live process uses; unsupported combinations;
* a file system that refuses ``O_DIRECT`` (injected): buffered I/O, the same bits as host offload;
* stale swap files of a killed run in the folder: removed, never read (the same bits as host offload);
* a disk that fills mid-run (an injected ``ENOSPC``): a ``DiskTierError`` naming the errno and the config key on
  every rank, and the checkpoint saved before it loads and resumes exactly;
* a swap file cut short under a running engine: a ``DiskTierError`` naming the short read.

``offload_param.buffer_size`` smaller than the largest parameter is no error (pages cut every unit's segment): the
offload sweep and the checkpoint tests train with pages far smaller than the parameters.
"""

import errno
import os

import pytest
import torch

from deepspeed.ops.adam import host_adam
from tests.unit.common import run_distributed
from tests.unit.harness import get_pool
from tests.unit.sweep.run import build_mlp, make_batch, mse

pytestmark = pytest.mark.skipif(host_adam.host_adam_op() is None, reason="the host Adam op cannot be built here")

WIDTHS = [9, 17, 5]


def _config(stage=3, opt="nvme", param="nvme", path=None, **extra_offload):
    zero = {"stage": stage, "reduce_bucket_size": 32, "sub_group_size": 16}
    zero["offload_optimizer"] = {"device": opt, "buffer_count": 3, **extra_offload}
    if opt == "nvme" and path is not None:
        zero["offload_optimizer"]["nvme_path"] = path
    if stage == 3:
        zero["offload_param"] = {"device": param, "buffer_size": 8, "buffer_count": 2, "max_in_cpu": 0}
        if param == "nvme" and path is not None:
            zero["offload_param"]["nvme_path"] = path
        zero.update(stage3_prefetch_bucket_size=40, stage3_param_persistence_threshold=4)
    return {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": float("inf"),
        "bf16": {
            "enabled": True
        },
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-2
            }
        },
        "zero_optimization": zero
    }


def _engine(config):
    import deepspeed
    torch.manual_seed(0)
    return deepspeed.initialize(model=build_mlp(WIDTHS), config=config)[0]


def _train(engine, rank, start, steps):
    losses = []
    for step in range(start, start + steps):
        x, y = make_batch(WIDTHS, rank, step, dtype=torch.bfloat16)
        loss = mse(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _raises(fn, kind, *words):
    try:
        fn()
    except kind as error:
        message = str(error)
        assert all(w in message for w in words), message
        return message
    raise AssertionError(f"{kind.__name__} not raised")


def _bad_paths(tmp):
    import deepspeed.comm as dist
    from deepspeed.runtime.config_utils import DeepSpeedConfigError
    from deepspeed.runtime.swap_tensor.swap_folder import SwapConfigError
    rank = dist.get_rank()
    _raises(lambda: _engine(_config(path=None)), DeepSpeedConfigError, "offload_optimizer.nvme_path", "required")
    missing = os.path.join(tmp, "missing")
    _raises(lambda: _engine(_config(path=missing)), SwapConfigError, missing, "does not exist")
    afile = os.path.join(tmp, "a_file")
    with open(afile, "w") as f:
        f.write("x")
    _raises(lambda: _engine(_config(path=afile)), SwapConfigError, "is not a folder")
    # one rank's path is missing: every rank stops before the first collective, naming the ranks
    good = os.path.join(tmp, "good")
    os.makedirs(good, exist_ok=True)
    _raises(lambda: _engine(_config(path=good
                                    if rank == 0 else missing)), DeepSpeedConfigError, "NVMe offload", "rank 1")
    for stage, bad, word in [(2, dict(super_offload=True), "super_offload"), (3, dict(ratio=0.5), "ratio")]:
        _raises(lambda: _engine(_config(stage=stage, path=good, **bad)), NotImplementedError, word, "nvme")
    # a folder a live process uses (its own lock here): the holder is named
    from deepspeed.runtime.swap_tensor.swap_folder import SwapFolder, optimizer_folder
    holder = SwapFolder(optimizer_folder(good, rank), "k")
    try:
        _raises(lambda: _engine(_config(stage=2, path=good)), SwapConfigError, "in use by pid")
    finally:
        holder.close()
    return True


def test_bad_paths_on_every_rank(tmp_path):
    assert run_distributed(_bad_paths, 2, args=(str(tmp_path), ), timeout=120) == [True, True]


def _equal_to_host_offload(tmp):
    """O_DIRECT refused and a killed run's files in the folder: trains to host offload's bits."""
    import deepspeed.comm as dist
    from deepspeed.runtime.swap_tensor.swap_folder import optimizer_folder, param_folder
    rank = dist.get_rank()
    host = _engine(_config(opt="cpu", param="cpu"))
    want = _train(host, rank, 0, 3)
    host.optimizer.state_dict()  # the last step, overlapping the next forward, completes
    params = [p.detach().clone() for p in host.optimizer.stage.masters]
    host.destroy()
    path = os.path.join(tmp, "nvme")
    for folder in (optimizer_folder(path, rank), param_folder(path, torch.bfloat16, rank)):
        os.makedirs(folder, exist_ok=True)
        for name in ("group0.fp32.tensor.swp", "group0.param.tensor.swp", "group0.exp_avg.tensor.swp"):
            with open(os.path.join(folder, name), "wb") as f:
                f.write(os.urandom(1 << 16))  # what a killed run left
    os.environ["DS_AIO_INJECT_FAULT"] = "direct:0:22"  # the file system refuses O_DIRECT
    try:
        engine = _engine(_config(path=path))
    finally:
        os.environ.pop("DS_AIO_INJECT_FAULT")
    stage = engine.optimizer.stage
    assert stage.host_step.swap.folder.probe_direct(stage.host_step.swap.io) is False
    assert _train(engine, rank, 0, 3) == want
    engine.optimizer.state_dict()  # the masters back in host memory
    assert all(torch.equal(a, b) for a, b in zip(stage.masters, params))
    assert stage.host_step.swap.io.direct_refused() > 0
    engine.destroy()
    return True


def test_buffered_io_and_stale_files(tmp_path):
    assert run_distributed(_equal_to_host_offload, 1, args=(str(tmp_path), ), timeout=120) == [True]


def _disk_fills(tmp, every_rank):
    import deepspeed.comm as dist
    from deepspeed.comm import PeerFailureError
    from deepspeed.runtime.swap_tensor.disk_tier import DiskTierError
    rank = dist.get_rank()
    path, ckpt = os.path.join(tmp, "nvme"), os.path.join(tmp, "ckpt")
    os.makedirs(path, exist_ok=True)
    engine = _engine(_config(stage=2, path=path))
    _train(engine, rank, 0, 2)
    engine.save_checkpoint(ckpt, tag="t")
    with torch.no_grad():
        x, y = make_batch(WIDTHS, rank, 100, dtype=torch.bfloat16)
        probe = mse(engine(x), y).item()
    if every_rank or rank == 1:
        engine.optimizer.stage.host_step.swap.io.inject_fault(1, 0, errno.ENOSPC)  # the disk is full from now on
    try:
        _train(engine, rank, 2, 2)
        raise AssertionError("a full disk went unnoticed")
    except DiskTierError as error:
        message = str(error)
        assert "errno 28" in message and "offload_optimizer.nvme_path" in message and path in message, message
        outcome = "disk"
    except PeerFailureError as error:
        assert not every_rank and rank == 0 and "rank 1" in str(error), str(error)
        outcome = "peer"
    engine.destroy()
    if not every_rank:
        return outcome
    # the checkpoint saved before the disk filled is intact
    fresh = _engine(_config(stage=2, opt="cpu"))
    fresh.load_checkpoint(ckpt, tag="t")
    with torch.no_grad():
        assert mse(fresh(x), y).item() == probe
    _train(fresh, rank, 2, 1)
    fresh.destroy()
    return outcome


@pytest.mark.parametrize("every_rank", [True, False], ids=["every-rank", "one-rank"])
def test_disk_fills_mid_run(tmp_path, every_rank):
    try:
        outcomes = run_distributed(_disk_fills, 2, args=(str(tmp_path), every_rank), timeout=180)
    finally:
        if not every_rank:  # the peer failure aborted the pool's group: the next test forms one in new processes
            get_pool(2).kill()
    assert outcomes == (["disk", "disk"] if every_rank else ["peer", "disk"])


def _short_read(tmp):
    from deepspeed.runtime.swap_tensor.disk_tier import DiskTierError
    engine = _engine(_config(stage=1, path=tmp))
    _train(engine, 0, 0, 1)
    swap = engine.optimizer.stage.host_step.swap
    engine.optimizer.stage.host_step.finish()  # on one rank the step may still run on the host worker
    swap.store.drop_cache()  # the next step reads every page from the file
    victim = swap.store._files[(0, "exp_avg")]
    with open(victim, "r+b") as f:
        f.truncate(4096)
    # the step reads in the background (one rank): the next forward, waiting for its pieces, raises
    _raises(lambda: _train(engine, 0, 1, 2), DiskTierError, "short read", victim, "offload_optimizer.nvme_path")
    return True


def test_short_read(tmp_path):
    assert run_distributed(_short_read, 1, args=(str(tmp_path), ), timeout=120) == [True]
