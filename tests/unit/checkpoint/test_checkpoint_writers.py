# SPDX-License-Identifier: Apache-2.0
"""``checkpoint.writer``: every writer round-trips; a decoupled save is the state at the call, however training
goes on while it is written; an operating system's error while writing reaches every rank named as such.

The reference is the engine's own state at the moment of the save (``snapshot``: fp32 masters, moments, step, model
parameters, LR, scheduler, counters), and a synchronous save of an identical run: both must load bitwise.
"""

import errno
import os
import resource
import signal

import pytest
import torch

from tests.unit.checkpoint import test_checkpoint_resume as common
from tests.unit.common import run_distributed

WORLD = 2
WRITERS = {
    "torch": None,
    "python": {
        "type": "python",
        "io_buffer_size": 4096,  # buffered writes that fill up many times per file
        "show_statistics": True
    },
    "fast": {
        "type": "fast"
    },
    "decoupled-fast": {
        "type": "fast",
        "decoupled": True
    },
    "decoupled-python": {
        "type": "python",
        "decoupled": True,
        "io_buffer_size": 8192
    },
}


def _config(stage, dtype, writer):
    cfg = common.make_config(stage, dtype)
    if writer is not None:
        cfg["checkpoint"] = {"writer": dict(writer)}
    return cfg


def _load_snapshot(cfg, save_dir, tag, seed, dim):
    engine = common.build_engine(cfg, seed=seed, dim=dim)
    engine.load_checkpoint(save_dir, tag=tag)
    snap = common.snapshot(engine)
    engine.destroy()
    return snap


def decoupled_while_training_worker(tmp, stage, dtype, dim):
    """A decoupled save, two more steps while it is written, then: the save loads as the state at the call, and as
    a synchronous save of the same run does."""
    rank = torch.distributed.get_rank()
    common.attach_checkpointing()
    writer = WRITERS["decoupled-fast"]
    engine = common.build_engine(_config(stage, dtype, writer), seed=0, dim=dim)
    common.train(engine, 2, 0, rank)
    at_save = common.snapshot(engine)
    engine.save_checkpoint(tmp, tag="async")
    common.train(engine, 2, 2, rank)  # the writer thread works while these steps change every tensor it staged
    after = common.snapshot(engine)
    assert common.differences(at_save, after), "training did not change the state"
    engine.destroy()  # waits for the write and the commit
    assert os.path.exists(os.path.join(tmp, "async", ".ds_complete"))
    with open(os.path.join(tmp, "latest")) as handle:
        assert handle.read() == "async"

    reference = common.build_engine(_config(stage, dtype, None), seed=0, dim=dim)
    common.train(reference, 2, 0, rank)
    reference.save_checkpoint(tmp, tag="sync", save_latest=False)
    reference.destroy()
    loaded_async = _load_snapshot(_config(stage, dtype, writer), tmp, "async", 5, dim)
    loaded_sync = _load_snapshot(_config(stage, dtype, None), tmp, "sync", 6, dim)
    assert not common.differences(at_save, loaded_async), common.differences(at_save, loaded_async)
    assert not common.differences(loaded_sync, loaded_async), common.differences(loaded_sync, loaded_async)
    return True


@pytest.mark.parametrize("stage,dtype,dim", [(1, "fp32", None), (3, "bf16", 7)], ids=["zero1-fp32", "zero3-bf16-odd"])
def test_decoupled_save_while_training_is_the_state_at_the_call(tmp_path, stage, dtype, dim):
    assert run_distributed(decoupled_while_training_worker,
                           WORLD,
                           args=(str(tmp_path), stage, dtype, dim),
                           timeout=180) == [True] * WORLD


def writer_round_trip_worker(tmp, stage, dtype, dim):
    rank = torch.distributed.get_rank()
    common.attach_checkpointing()
    outcome = {}
    for name, writer in WRITERS.items():
        save_dir = os.path.join(tmp, name)
        engine = common.build_engine(_config(stage, dtype, writer), seed=1, dim=dim)
        common.train(engine, 1, 0, rank)
        expected = common.snapshot(engine)
        engine.save_checkpoint(save_dir)
        engine.save_checkpoint(save_dir, tag="second")  # a decoupled writer: waits for the first save
        if writer is not None and writer.get("show_statistics"):
            stats = engine.checkpoint_engine.statistics
            assert stats and all(nbytes > 0 for _, nbytes, _ in stats), stats
        engine.destroy()
        for tag in (None, "second"):
            got = _load_snapshot(_config(stage, dtype, writer), save_dir, tag, 9, dim)
            bad = common.differences(expected, got)
            assert not bad, f"{name} {tag}: {bad}"
        outcome[name] = sorted(n for n in os.listdir(os.path.join(save_dir, "global_step1")))
    return outcome


def test_every_writer_round_trips(tmp_path):
    gen = torch.Generator().manual_seed(38)
    dim = int(torch.randint(3, 12, (1, ), generator=gen))  # an odd-sized model, seeded
    outcomes = run_distributed(writer_round_trip_worker, WORLD, args=(str(tmp_path), 2, "fp32", dim), timeout=240)
    listings = {tuple(files) for outcome in outcomes for files in outcome.values()}
    assert len(listings) == 1, listings  # every writer lays out the same files
    files = listings.pop()
    assert ".ds_complete" in files and not [f for f in files if ".tmp-" in f], files


def full_disk_worker(tmp, decoupled, failing_ranks):
    """``ENOSPC`` injected below torch's serializer on ``failing_ranks``: every rank gets CheckpointError with the
    errno, its text and the file; ``latest`` and the previous tag are untouched and load."""
    from deepspeed.runtime.checkpoint import CheckpointError
    from deepspeed.runtime.checkpoint_engine.file_writers import WRITE_FAULT_ENV
    rank = torch.distributed.get_rank()
    common.attach_checkpointing()
    writer = WRITERS["decoupled-python"] if decoupled else None
    cfg = _config(1, "fp32", writer)
    engine = common.build_engine(cfg, seed=2)
    common.train(engine, 1, 0, rank)
    engine.save_checkpoint(tmp, tag="good")
    expected = common.snapshot(engine)
    common.train(engine, 1, 1, rank)
    if rank in failing_ranks:
        os.environ[WRITE_FAULT_ENV] = "100:28"  # the disk fills after 100 bytes of a file
    with pytest.raises(CheckpointError) as caught:
        engine.save_checkpoint(tmp, tag="full")
        engine.checkpoint_engine.wait()  # decoupled: the failure comes with the commit
    os.environ.pop(WRITE_FAULT_ENV, None)
    error = caught.value
    message = str(error)
    assert "[Errno 28] No space left on device" in message, message
    assert os.path.join(tmp, "full") in message and "_states.pt" in message, message
    assert "enforce fail" not in message and "unexpected pos" not in message.split("surfaced")[0], message
    for other in range(WORLD):  # each failing rank is named, with its own file
        assert (f"rank {other}: OSError: [Errno 28]" in message) == (other in failing_ranks), message
    assert error.errno == errno.ENOSPC and error.strerror == os.strerror(errno.ENOSPC), (error.errno, error.strerror)
    assert error.filename.startswith(os.path.join(tmp, "full")), error.filename
    with open(os.path.join(tmp, "latest")) as handle:
        assert handle.read() == "good"
    engine.destroy()
    got = _load_snapshot(cfg, tmp, None, 4, None)
    assert not common.differences(expected, got), common.differences(expected, got)
    return message


@pytest.mark.parametrize("decoupled,failing", [(False, (0, 1)), (True, (1, ))],
                         ids=["sync-every-rank", "decoupled-rank1"])
def test_full_disk_is_named_on_every_rank(tmp_path, decoupled, failing):
    messages = run_distributed(full_disk_worker, WORLD, args=(str(tmp_path), decoupled, failing), timeout=120)
    assert messages[0] == messages[1], messages  # the same account on every rank


def test_real_write_error_is_the_os_error_not_torchs(tmp_path):
    """A real kernel error below torch's zip writer (a file-size limit: ``EFBIG``) reaches the caller as that
    ``OSError`` with the file's path; torch alone reports ``RuntimeError: ... unexpected pos``."""
    from deepspeed.runtime.checkpoint.writer import atomic_torch_save
    state = {"w": torch.randn(64, 1024)}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    path = str(tmp_path / "model.pt")
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
        with pytest.raises(RuntimeError):  # what torch says on its own
            torch.save(state, str(tmp_path / "plain.pt"))
        with pytest.raises(OSError) as caught:
            atomic_torch_save(state, path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert caught.value.errno == errno.EFBIG and caught.value.filename == path, caught.value
    assert not os.path.exists(path) and os.listdir(tmp_path) == ["plain.pt"], os.listdir(tmp_path)


@pytest.mark.parametrize("section,words", [
    ({
        "checkpoint": {
            "writer": {
                "type": "mock"
            }
        }
    }, "checkpoint.writer.type"),
    ({
        "datastates_ckpt": {}
    }, "datastates_ckpt"),
    ({
        "zero_optimization": {
            "stage": 3,
            "mics_shard_size": 2
        }
    }, "zero_optimization.mics_shard_size"),
    ({
        "zero_optimization": {
            "stage": 3,
            "mics_hierarchical_params_gather": False
        }
    }, "zero_optimization.mics_hierarchical_params_gather"),
])
def test_writers_and_keys_that_cannot_be_honoured_are_refused_by_name(section, words):
    from deepspeed.runtime.config import DeepSpeedConfig
    with pytest.raises(Exception, match=words.replace(".", r"\.")) as caught:
        DeepSpeedConfig(dict({"train_micro_batch_size_per_gpu": 1}, **section))
    assert isinstance(caught.value, (NotImplementedError, ValueError, AssertionError)) or \
        type(caught.value).__name__ == "DeepSpeedConfigError", type(caught.value)


def test_fast_file_writer_round_trips_and_names_a_full_disk(tmp_path, monkeypatch):
    """The ``async_io`` file writer (measured, not the default: docs/checkpoints.md) writes what torch.save writes,
    double- and single-buffered, and a failed aio write is the operating system's error."""
    from deepspeed.ops.aio import AsyncIOBuilder
    from deepspeed.ops.aio.buffers import aligned_empty
    from deepspeed.runtime.checkpoint_engine.file_writers import FastFileWriter, serialize
    gen = torch.Generator().manual_seed(5)
    state = {
        "a": torch.randn(1000, 37, generator=gen),
        "b": torch.arange(5),
        "c": [torch.ones(3, dtype=torch.bfloat16)]
    }
    handle = AsyncIOBuilder().load(verbose=False).aio_handle(block_size=8192, queue_depth=4)
    for count in (1, 2):
        path = str(tmp_path / f"fast{count}.pt")
        serialize(state, FastFileWriter(path, handle, [aligned_empty(8192) for _ in range(count)]))
        got = torch.load(path)
        assert torch.equal(got["a"], state["a"]) and torch.equal(got["b"], state["b"])
        assert torch.equal(got["c"][0], state["c"][0])
    monkeypatch.setenv("DS_CHECKPOINT_TEST_WRITE_FAULT", "9000:28")
    with pytest.raises(OSError) as caught:
        serialize(state, FastFileWriter(str(tmp_path / "full.pt"), handle, [aligned_empty(8192)]))
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "full.pt")
    handle.close()
