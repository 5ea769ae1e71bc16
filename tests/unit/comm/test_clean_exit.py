# SPDX-License-Identifier: Apache-2.0
"""Many short 2-process training jobs; every one must exit cleanly.

A gloo worker thread still running when the interpreter shuts down ends the process in
``std::terminate`` ("terminate called without an active exception", exit code 134) in some runs only.
Each job (``exit_job.py``) also checks the cause directly, so a regression fails every time rather than
in a fraction of runs: no gloo worker thread may outlive ``destroy_process_group()``, nor reach
interpreter exit when the script never destroyed the group. One job goes through the ``deepspeed``
launcher (torchrun), the others start their two ranks directly, which is faster.
"""

import os
import subprocess
import sys
import time

import pytest

from deepspeed.comm.env import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_job.py")
JOB_TIMEOUT_S = 120
MODES = ["destroy", "keep", "destroy", "keep"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU processes on gloo even on a GPU machine
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run_direct(mode):
    """Start both ranks of one job; return [(returncode, stderr)] per rank."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = _env()
        env.update(RANK=str(rank),
                   LOCAL_RANK=str(rank),
                   WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port)
        procs.append(
            subprocess.Popen([sys.executable, JOB, mode],
                             env=env,
                             stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE,
                             text=True))
    results = []
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def _run_launcher(mode):
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", "/nonexistent/hostfile", "--num_gpus", "2",
        "--master_port",
        str(free_port()), "--no_local_rank", JOB, mode
    ]
    done = subprocess.run(cmd,
                          env=_env(),
                          stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE,
                          text=True,
                          timeout=JOB_TIMEOUT_S)
    return [(done.returncode, done.stderr)]


def _assert_clean(label, results):
    for rank, (code, err) in enumerate(results):
        assert "terminate called" not in err, f"{label} rank {rank}: native crash at exit\n{err[-3000:]}"
        assert code == 0, f"{label} rank {rank}: exit code {code}\n{err[-3000:]}"


@pytest.mark.parametrize("job", range(len(MODES)))
def test_direct_jobs_exit_cleanly(job):
    mode = MODES[job]
    _assert_clean(f"job {job} ({mode})", _run_direct(mode))


def test_launcher_job_exits_cleanly():
    _assert_clean("launcher job (keep)", _run_launcher("keep"))
