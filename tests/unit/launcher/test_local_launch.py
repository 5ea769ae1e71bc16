# SPDX-License-Identifier: Apache-2.0
"""One node: the deepspeed command runs this node's agent, which runs torchrun; real processes, no torch in them."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from deepspeed.launcher import runner

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
NO_HOSTFILE = ["--hostfile", "/nonexistent/hostfile"]
TIMEOUT_S = 180


def test_run_command_exit_status():
    assert runner.run_command([sys.executable, "-c", "import sys; sys.exit(3)"], os.environ) == 3
    assert runner.run_command([sys.executable, "-c", "pass"], os.environ) == 0
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert runner.run_command([sys.executable, "-c", killed], os.environ) == 128 + signal.SIGKILL


def test_run_command_forwards_sigterm(tmp_path):
    ready = tmp_path / "ready"
    child = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
             f"open({str(ready)!r}, 'w').close()\n"
             "time.sleep(30)\n")

    def terminate_when_ready():
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    handler_before = signal.getsignal(signal.SIGTERM)
    sender = threading.Thread(target=terminate_when_ready)
    sender.start()
    status = runner.run_command([sys.executable, "-c", child], os.environ)
    sender.join()
    assert status == 7  # the child got the signal and chose its status
    assert signal.getsignal(signal.SIGTERM) is handler_before  # the launcher's handler is removed again


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


WORKER = """
import json, os, sys
local_rank_arg = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--local_rank=")]
out_dir = sys.argv[-1]
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS", "FROM_ENV_FILE", "CROSS_RANK", "LOCAL_SIZE")
record = {key: os.environ.get(key) for key in keys}
record["local_rank_arg"] = local_rank_arg
with open(os.path.join(out_dir, "rank" + os.environ["RANK"] + ".json"), "w") as handle:
    json.dump(record, handle)
if "--fail" in sys.argv and os.environ["RANK"] == "1":
    sys.exit(3)
"""


def _launch(tmp_path, *script_args):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / ".deepspeed_env").write_text("FROM_ENV_FILE=yes\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("OMP_NUM_THREADS", None)
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU processes even on a GPU machine
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", *NO_HOSTFILE, "--num_gpus", "2", "--master_port",
        str(_free_port()), "worker.py", *script_args,
        str(tmp_path)
    ]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_two_cpu_processes(tmp_path):
    done = _launch(tmp_path, "--flag")
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as handle:
            record = json.load(handle)
        assert record["RANK"] == str(rank)
        assert record["WORLD_SIZE"] == "2"
        assert record["LOCAL_RANK"] == str(rank)
        assert record["local_rank_arg"] == [str(rank)]
        assert record["OMP_NUM_THREADS"] == "1"
        assert record["FROM_ENV_FILE"] == "yes"
        assert (record["CROSS_RANK"], record["LOCAL_SIZE"]) == ("0", "2")


def test_failing_rank_sets_the_exit_status(tmp_path):
    done = _launch(tmp_path, "--fail")
    assert done.returncode == 3, done.stderr[-3000:]
    assert "node 0 (localhost): rank 1 failed first with exit code 3" in done.stderr
