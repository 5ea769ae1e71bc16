# SPDX-License-Identifier: Apache-2.0
"""End to end: one machine stands in for two nodes of two processes, behind fake ssh, pdsh, srun and mpirun.

The fakes (fakes/fake_launchers.py) run each "node" locally in the environment the real program would give it,
so what the job sees is what the launcher sent. The job (fakes/check_ranks.py) records its rank, world size,
local rank, node, the exported variables and an all-reduce; expected values are written out by hand.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.unit.launcher.fakes import fake_launchers

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
CHECK_SCRIPT = os.path.join(HERE, "fakes", "check_ranks.py")
JOB_TIMEOUT_S = 240
# Characters a shell would otherwise expand or split on.
PYTHON_MARK = "a b (c) $HOME 'q' \"d\" `e` ;f"
FILE_VALUE = "x y $z (w)"
HOSTS = ("127.0.0.1", "localhost")


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def job(tmp_path):
    """A launch directory with a hostfile and a .deepspeed_env, fakes first on PATH, and the job's environment."""
    bin_dir, home, cwd, out = (tmp_path / name for name in ("bin", "home", "job", "out"))
    for folder in (bin_dir, home, cwd, out):
        folder.mkdir()
    fake_launchers.install(str(bin_dir))
    (cwd / "hostfile").write_text("".join(f"{host} slots=2\n" for host in HOSTS))
    (cwd / ".deepspeed_env").write_text(f"DS_FILE_VALUE={FILE_VALUE}\n")
    env = dict(os.environ)
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
               HOME=str(home),
               PYTHONPATH=REPO_ROOT,
               CUDA_VISIBLE_DEVICES="",
               PYTHON_MARK=PYTHON_MARK,
               NCCL_MARK="nccl",
               NOT_EXPORTED="1",
               DS_LAUNCHER_START_TIMEOUT="200")
    env.pop("OMP_NUM_THREADS", None)
    return {"cwd": cwd, "out": out, "env": env}


def _deepspeed(job, *argv, fail_rank=None):
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", "hostfile", "--master_port",
        str(_free_port()), *argv, CHECK_SCRIPT,
        str(job["out"])
    ]
    cmd += [] if fail_rank is None else [str(fail_rank)]
    return subprocess.run(cmd, cwd=job["cwd"], env=job["env"], capture_output=True, text=True, timeout=JOB_TIMEOUT_S)


def _records(out_dir, world_size=4):
    records = []
    for rank in range(world_size):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as handle:
            records.append(json.load(handle))
    return records


def _check_world(records, *, passes_local_rank=True, cross_rank=True):
    for rank, record in enumerate(records):
        assert record["rank"] == rank
        assert record["world_size"] == 4
        assert record["local_rank_env"] == str(rank % 2)
        assert record["all_reduce"] == 1.0 + 2.0 + 3.0 + 4.0
        if passes_local_rank:
            assert record["local_rank_args"] == [str(rank % 2)]
        if cross_rank:
            assert record["cross_rank"] == str(rank // 2)


def _check_exports(records, launcher):
    for record in records:
        assert record["PYTHON_MARK"] == PYTHON_MARK
        assert record["DS_FILE_VALUE"] == FILE_VALUE
        assert record["NCCL_MARK"] == "nccl"
        # Only srun hands the whole environment over (--export=ALL); the others send the exported prefixes only.
        assert record["NOT_EXPORTED"] == ("1" if launcher == "slurm" else None)


# Each launcher is run once; the ssh and openmpi runs are the failure and interrupt tests below, which check the
# same world before they stop it (every run starts seven Python processes: the suite runs on two cores).
@pytest.mark.parametrize("launcher", ["pdsh", "slurm"])
def test_two_nodes_of_two(job, launcher):
    done = _deepspeed(job, "--launcher", launcher)
    assert done.returncode == 0, done.stderr[-4000:]
    records = _records(job["out"])
    _check_world(records)
    _check_exports(records, launcher)


def test_srun_without_the_launcher(job):
    env = dict(job["env"], MASTER_PORT=str(_free_port()))
    cmd = [
        "srun", "-n", "4", "--ntasks-per-node=2", "--nodelist=127.0.0.[1-2]", sys.executable, CHECK_SCRIPT,
        str(job["out"])
    ]
    done = subprocess.run(cmd, cwd=job["cwd"], env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    _check_world(_records(job["out"]), passes_local_rank=False, cross_rank=False)


def test_mpirun_without_the_launcher(job):
    cmd = [
        "mpirun", "-n", "4", "--host", ",".join(HOSTS), "--map-by", "ppr:2:node", "-x", f"PYTHONPATH={REPO_ROOT}",
        "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={_free_port()}", sys.executable, CHECK_SCRIPT,
        str(job["out"])
    ]
    done = subprocess.run(cmd, cwd=job["cwd"], env=job["env"], capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    _check_world(_records(job["out"]), passes_local_rank=False, cross_rank=False)


def _assert_all_stopped(out_dir):
    pids = [int(open(os.path.join(out_dir, f"pid{rank}")).read()) for rank in range(4)]
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        time.sleep(0.1)
    assert not alive, f"ranks still running: {alive}"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_failing_rank_stops_every_node(job):
    done = _deepspeed(job, "--launcher", "ssh", fail_rank=2)  # rank 2 is the first process of node 1
    assert done.returncode == 3, done.stderr[-4000:]
    records = _records(job["out"])
    _check_world(records)
    _check_exports(records, "ssh")
    assert "node 1 (localhost), rank 2, failed first with exit code 3" in done.stderr, done.stderr[-4000:]
    _assert_all_stopped(job["out"])


def test_interrupt_stops_every_node(job):
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", "hostfile", "--master_port",
        str(_free_port()), "--launcher", "openmpi", CHECK_SCRIPT,
        str(job["out"]), "99"
    ]
    head = subprocess.Popen(cmd, cwd=job["cwd"], env=job["env"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while len([n for n in os.listdir(job["out"]) if n.startswith("pid")]) < 4:
            assert time.monotonic() < deadline and head.poll() is None, "the job did not start"
            time.sleep(0.2)
        head.send_signal(signal.SIGINT)
        _, err = head.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if head.poll() is None:
            head.kill()
            head.communicate()
    assert head.returncode == 128 + signal.SIGINT, err[-4000:]
    records = _records(job["out"])
    _check_world(records)
    _check_exports(records, "openmpi")
    _assert_all_stopped(job["out"])


def test_node_that_never_starts_stops_the_others(job):
    env = dict(job["env"], FAKE_SSH_SILENT="localhost", DS_LAUNCHER_START_TIMEOUT="5")
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", "hostfile", "--master_port",
        str(_free_port()), "--launcher", "ssh", "--no_ssh_check", CHECK_SCRIPT,
        str(job["out"])
    ]
    done = subprocess.run(cmd, cwd=job["cwd"], env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 1, done.stderr[-4000:]
    assert "node 1 (localhost) failed first with exit code 1: its node agent did not connect within 5 s" in done.stderr
    # Node 0's agent, waiting in the rendezvous for node 1, is gone too.
    token = re.search(r"--job_token=(\w+)", done.stderr).group(1)
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and token in _cmdline(pid)]


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def test_unreachable_host_is_reported_before_anything_starts(job):
    env = dict(job["env"], FAKE_SSH_UNREACHABLE="localhost")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", "hostfile", CHECK_SCRIPT, str(job["out"])]
    done = subprocess.run(cmd, cwd=job["cwd"], env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode != 0
    assert "not reachable over password-less ssh: localhost" in done.stderr, done.stderr[-4000:]
    assert os.listdir(job["out"]) == []
