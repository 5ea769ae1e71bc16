# SPDX-License-Identifier: Apache-2.0
"""Crash safety: a rank killed in the middle of a save leaves the previous checkpoint loadable.

The test starts two ranks of its own (this file run as a script, gloo on localhost),
saves the tag ``good``, trains one more step and saves ``bad`` with the test hook
``DS_CHECKPOINT_TEST_PAUSE_AFTER_FILES`` set on one rank: that rank stops after writing
that many files and is SIGKILLed (then the other, blocked in the save's agreement). Then
``latest`` still names ``good``, and a fresh engine loads it (through the pool) with the
fp32 values it had when it was saved; an explicit load of ``bad`` is refused as incomplete
(no completeness mark).

The decoupled cell does the same with ``checkpoint.writer.decoupled``: the pause hits the victim's
writer thread, both ranks train on (their training collectives run while the write is stuck), and
the survivor's writer waits in the commit for the victim's.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests.unit.checkpoint import test_checkpoint_resume as common
from tests.unit.common import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
WORLD = 2
START_TIMEOUT_S = 120
OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fp32_values(engine):
    snap = common.snapshot(engine)
    return {key: value for key, value in snap.items() if key.startswith("fp32/")}


def _config(decoupled):
    cfg = common.make_config(1, "fp32")
    if decoupled:
        cfg["checkpoint"] = {"writer": {"type": "python", "decoupled": True}}
    return cfg


def child_main(save_dir, rank, port, victim, pause_after, marker, decoupled=False):
    """One rank of the crashing job (run as ``python -m tests.unit.checkpoint.test_checkpoint_crash``)."""
    os.environ.update(RANK=str(rank),
                      WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from deepspeed.runtime.checkpoint.writer import PAUSE_AFTER_FILES_ENV, PAUSE_MARKER_ENV
    common.attach_checkpointing()
    engine = common.build_engine(_config(decoupled), seed=0)
    common.train(engine, 2, 0, rank)
    engine.save_checkpoint(save_dir, tag="good")
    if decoupled:
        engine.checkpoint_engine.wait()
    values = _fp32_values(engine)
    if rank == 0:
        torch.save(values, os.path.join(save_dir, "good_values.pt"))
    common.train(engine, 1, 2, rank)
    if rank == victim:
        os.environ[PAUSE_AFTER_FILES_ENV] = str(pause_after)
        os.environ[PAUSE_MARKER_ENV] = marker
    engine.save_checkpoint(save_dir, tag="bad")
    if decoupled:  # training goes on while the victim's writer is stuck
        common.train(engine, 2, 3, rank)
        with open(f"{marker}.trained{rank}", "w"):
            pass
        while True:
            time.sleep(3600)
    raise SystemExit("the save was expected to pause on the victim rank")


def _logs(paths):
    out = []
    for path in paths:
        with open(path, "rb") as handle:
            out.append(f"--- {path}\n" + handle.read().decode(errors="replace")[-3000:])
    return "\n".join(out)


def _run_crashing_job(save_dir, victim, pause_after, work, decoupled=False):
    marker = os.path.join(work, "paused")
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    logs = [os.path.join(work, f"rank{rank}.log") for rank in range(WORLD)]
    procs = []
    try:
        for rank in range(WORLD):
            with open(logs[rank], "wb") as log:
                procs.append(
                    subprocess.Popen([
                        sys.executable, "-m", "tests.unit.checkpoint.test_checkpoint_crash", save_dir,
                        str(rank),
                        str(port),
                        str(victim),
                        str(pause_after), marker,
                        str(int(decoupled))
                    ],
                                     cwd=REPO,
                                     env=env,
                                     stdout=log,
                                     stderr=subprocess.STDOUT,
                                     start_new_session=True))
        deadline = time.monotonic() + START_TIMEOUT_S
        expected = [marker] + ([f"{marker}.trained{rank}" for rank in range(WORLD)] if decoupled else [])
        while not all(os.path.exists(path) for path in expected):
            if time.monotonic() > deadline:
                raise AssertionError(f"the victim rank did not pause within {START_TIMEOUT_S} s\n{_logs(logs)}")
            if any(p.poll() is not None for p in procs):
                raise AssertionError(f"a rank exited before the pause\n{_logs(logs)}")
            time.sleep(0.05)
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait(timeout=10)
        assert procs[victim].returncode == -signal.SIGKILL
    finally:
        for proc in procs:  # the survivor waits in the save's agreement for the killed rank
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
    return _logs(logs)


def load_after_crash_worker(save_dir, decoupled):
    from deepspeed.runtime.checkpoint import CheckpointError
    common.attach_checkpointing()
    engine = common.build_engine(_config(decoupled), seed=3)
    path, _ = engine.load_checkpoint(save_dir)
    assert path == os.path.join(save_dir, "good", "mp_rank_00_model_states.pt"), path
    expected = torch.load(os.path.join(save_dir, "good_values.pt"))
    bad = common.differences(expected, _fp32_values(engine))
    assert not bad, bad
    with pytest.raises(CheckpointError, match="bad: incomplete checkpoint: the save of tag 'bad' did not finish"):
        engine.load_checkpoint(save_dir, tag="bad")
    engine.destroy()
    return True


@pytest.mark.parametrize("victim,pause_after,decoupled", [(0, 1, False), (1, 0, True)],
                         ids=["rank0-after-model-states", "decoupled-rank1-before-any"])
def test_killed_rank_mid_save_leaves_previous_checkpoint(tmp_path, victim, pause_after, decoupled):
    save_dir = str(tmp_path / "ckpt")
    os.makedirs(save_dir)
    logs = _run_crashing_job(save_dir, victim, pause_after, str(tmp_path), decoupled)
    assert "pausing after" in logs
    with open(os.path.join(save_dir, "latest")) as handle:
        assert handle.read() == "good"
    written = sorted(os.listdir(os.path.join(save_dir, "bad")))
    if victim == 0:  # the model states are written, rank 0's partition is not
        assert "mp_rank_00_model_states.pt" in written and OPTIM.format(0) not in written, written
    else:
        assert OPTIM.format(1) not in written, written
    assert not [name for name in written if ".tmp-" in name], written
    assert ".ds_complete" not in written and os.path.exists(os.path.join(save_dir, "good", ".ds_complete"))
    assert run_distributed(load_after_crash_worker, WORLD, args=(save_dir, decoupled), timeout=60) == [True] * WORLD


if __name__ == "__main__":
    directory, rank_arg, port_arg, victim_arg, pause_arg, marker_arg, decoupled_arg = sys.argv[1:8]
    child_main(directory, int(rank_arg), int(port_arg), int(victim_arg), int(pause_arg), marker_arg,
               bool(int(decoupled_arg)))
