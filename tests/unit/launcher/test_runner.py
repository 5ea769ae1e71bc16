# SPDX-License-Identifier: Apache-2.0
"""Tests of the ``deepspeed`` launcher: the torchrun command line and environment it builds, and real launches.

Expected command lines are written out by hand from torchrun's documented flags, so they do not depend on the
code under test.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from deepspeed.launcher import runner

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
NO_HOSTFILE = ["--hostfile", "/nonexistent/hostfile"]


def torchrun(nproc, nnodes=1, node_rank=0, addr="127.0.0.1", port=29500):
    """The expected launcher prefix, written out from torchrun's flags."""
    return [
        "PY", "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={nnodes}",
        f"--node_rank={node_rank}", f"--master_addr={addr}", f"--master_port={port}"
    ]


def write_hostfile(tmp_path, text):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def command_for(argv, device_count):
    args = runner.parse_args(argv)
    plan = runner.plan_launch(args, device_count=device_count)
    return runner.build_torchrun_command(args, plan, python="PY"), plan


LR = "--local_rank=${local_rank}"

# yapf: disable
COMMAND_CASES = [
    # CPU: one process unless --num_gpus asks for more.
    (["train.py", "--steps", "5"], 0, torchrun(1) + ["train.py", LR, "--steps", "5"]),
    (["--num_gpus", "2", "train.py"], 0, torchrun(2) + ["train.py", LR]),
    (["--num_accelerators=3", "train.py"], 0, torchrun(3) + ["train.py", LR]),
    # GPU: every visible device by default.
    (["train.py"], 4, torchrun(4) + ["train.py", LR]),
    (["--num_gpus", "2", "--master_port", "1234", "--no_local_rank", "train.py", "--a", "b"], 8,
     torchrun(2, port=1234) + ["train.py", "--a", "b"]),
    # Launcher options after the script belong to the script.
    (["train.py", "--num_gpus", "7"], 0, torchrun(1) + ["train.py", LR, "--num_gpus", "7"]),
    (["--module", "pkg.train", "--x"], 0, torchrun(1) + ["--module", "pkg.train", LR, "--x"]),
    (["--no_python", "--no_local_rank", "--", "bash", "run.sh"], 0, torchrun(1) + ["--no_python", "bash", "run.sh"]),
    (["--include", "localhost:1,3", "train.py"], 4, torchrun(2) + ["train.py", LR]),
    (["--exclude", "localhost:0", "train.py"], 4, torchrun(3) + ["train.py", LR]),
    # Several nodes, torchrun style: the same command on every node with its --node_rank.
    (["--num_nodes", "2", "--node_rank", "1", "--master_addr", "node0", "--num_gpus", "8", "train.py"], 8,
     torchrun(8, nnodes=2, node_rank=1, addr="node0") + ["train.py", LR]),
    (["--num_nodes=3", "--node_rank=0", "--master_addr=10.1.2.3", "--master_port=6000", "train.py"], 0,
     torchrun(1, nnodes=3, node_rank=0, addr="10.1.2.3", port=6000) + ["train.py", LR]),
]
# yapf: enable


@pytest.mark.parametrize("argv, device_count, expected", COMMAND_CASES)
def test_torchrun_command(argv, device_count, expected):
    cmd, _ = command_for(NO_HOSTFILE + argv, device_count)
    assert cmd == expected


def test_hostfile_single_host_runs_locally(tmp_path):
    hostfile = write_hostfile(tmp_path, "# workers\nworker-0 slots=4\n\n")
    cmd, plan = command_for(["--hostfile", hostfile, "train.py"], 4)
    assert cmd == torchrun(4) + ["train.py", LR]
    assert plan.local_slots == (0, 1, 2, 3)


def test_hostfile_several_hosts_with_node_rank(tmp_path):
    hostfile = write_hostfile(tmp_path, "worker-0 slots=4\nworker-1 slots=2\nworker-2 slots=4\n")
    cmd, plan = command_for(["--hostfile", hostfile, "--exclude", "worker-1", "--node_rank", "1", "train.py"], 4)
    assert cmd == torchrun(4, nnodes=2, node_rank=1, addr="worker-0") + ["train.py", LR]
    cmd, plan = command_for(["--hostfile", hostfile, "--num_nodes", "2", "--node_rank", "1", "train.py"], 2)
    assert cmd == torchrun(2, nnodes=2, node_rank=1, addr="worker-0") + ["train.py", LR]


@pytest.mark.parametrize(
    "argv, device_count, error",
    [
        (["--num_nodes", "2", "train.py"], 0, NotImplementedError),
        (["--num_nodes", "2", "--node_rank", "1", "train.py"], 0, ValueError),  # no --master_addr
        (["--num_nodes", "2", "--node_rank", "2", "--master_addr", "a", "train.py"], 0, ValueError),
        (["--force_multi", "train.py"], 0, NotImplementedError),
        (["--include", "localhost:0", "--exclude", "localhost:1", "train.py"], 2, ValueError),
        (["--include", "localhost:0", "--num_gpus", "1", "train.py"], 2, ValueError),
        (["--include", "localhost:5", "train.py"], 2, ValueError),
        (["--include", "otherhost", "train.py"], 2, ValueError),
        (["--num_gpus", "3", "train.py"], 2, ValueError),
    ])
def test_invalid_plans(argv, device_count, error):
    with pytest.raises(error):
        runner.plan_launch(runner.parse_args(NO_HOSTFILE + argv), device_count=device_count)


def test_several_hostfile_hosts_without_node_rank_is_not_implemented(tmp_path):
    hostfile = write_hostfile(tmp_path, "a slots=1\nb slots=1\n")
    with pytest.raises(NotImplementedError, match="--node_rank"):
        runner.plan_launch(runner.parse_args(["--hostfile", hostfile, "train.py"]), device_count=0)


def test_module_and_no_python_conflict():
    with pytest.raises(SystemExit):
        runner.parse_args(["--module", "--no_python", "x"])


@pytest.mark.parametrize("text", ["worker-0\n", "worker-0 slots=x\n", "w slots=1\nw slots=2\n", "# only\n"])
def test_malformed_hostfile(tmp_path, text):
    with pytest.raises(ValueError):
        runner.fetch_hostfile(write_hostfile(tmp_path, text))


# yapf: disable
FILTER_CASES = [
    ("", "", {"a": [0, 1, 2], "b": [0, 1]}),
    ("b", "", {"b": [0, 1]}),
    ("b:1@a:2,0", "", {"a": [0, 2], "b": [1]}),  # hostfile order, sorted slots
    ("", "a:1", {"a": [0, 2], "b": [0, 1]}),
    ("", "a@b:0", {"b": [1]}),
    ("", "b:0,1", {"a": [0, 1, 2]}),  # a host with no slot left is dropped
]
# yapf: enable


@pytest.mark.parametrize("include, exclude, expected", FILTER_CASES)
def test_inclusion_exclusion(include, exclude, expected):
    active = runner.parse_inclusion_exclusion({"a": 3, "b": 2}, include, exclude)
    assert dict(active) == expected
    assert list(active) == [host for host in ("a", "b") if host in expected]


def _plan(nproc, slots=None, device_count=0):
    slots = tuple(range(nproc)) if slots is None else tuple(slots)
    return runner.LaunchPlan(nproc, 1, 0, "127.0.0.1", 29500, slots, device_count)


def test_child_env_threads_and_pythonpath():
    env = runner.build_child_env(_plan(2), {"PATH": "/bin", "PYTHONPATH": "/lib"}, cwd="/launch")
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["PYTHONPATH"] == "/launch" + os.pathsep + "/lib"
    assert env["PATH"] == "/bin"
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert "OMP_NUM_THREADS" not in runner.build_child_env(_plan(1), {}, cwd="/launch")
    assert runner.build_child_env(_plan(2), {"OMP_NUM_THREADS": "4"}, cwd="/x")["OMP_NUM_THREADS"] == "4"


def test_child_env_visible_devices():
    # All devices used: the parent's setting is left alone.
    assert "CUDA_VISIBLE_DEVICES" not in runner.build_child_env(_plan(4, device_count=4), {}, cwd="/x")
    env = runner.build_child_env(_plan(2, [1, 3], device_count=4), {}, cwd="/x")
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3"
    # Slots index the devices already visible.
    env = runner.build_child_env(_plan(2, [0, 2], device_count=3), {"CUDA_VISIBLE_DEVICES": "4,5,7"}, cwd="/x")
    assert env["CUDA_VISIBLE_DEVICES"] == "4,7"


def test_environment_files(tmp_path):
    assert runner.DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".deepspeed_env").write_text("# comment\n\nexport B=cwd=1\nC = spaced \n")
    paths = runner.environment_file_paths(cwd=str(cwd), home=str(home), environ={})
    assert paths == [str(home / ".deepspeed_env"), str(cwd / ".deepspeed_env")]
    values = runner.read_environment_files(paths)
    assert values == {"A": "home", "B": "cwd=1", "C": "spaced"}
    env = runner.build_child_env(_plan(1), {"A": "shell", "D": "shell"}, values, cwd=str(cwd))
    assert (env["A"], env["B"], env["D"]) == ("home", "cwd=1", "shell")
    (cwd / ".deepspeed_env").write_text("NOT_AN_ASSIGNMENT\n")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        runner.read_environment_files(paths)


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
    start = time.monotonic()
    status = runner.run_command([sys.executable, "-c", child], os.environ)
    sender.join()
    assert status == 128 + signal.SIGTERM
    assert time.monotonic() - start < 20
    assert signal.getsignal(signal.SIGTERM) is handler_before  # the launcher's handler is removed again


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


WORKER = """
import json, os, sys
local_rank_arg = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--local_rank=")]
out_dir = sys.argv[-1]
record = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS", "FROM_ENV_FILE")}
record["local_rank_arg"] = local_rank_arg
with open(os.path.join(out_dir, "rank" + os.environ["RANK"] + ".json"), "w") as handle:
    json.dump(record, handle)
"""


def test_real_launch_two_cpu_processes(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / ".deepspeed_env").write_text("FROM_ENV_FILE=yes\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("OMP_NUM_THREADS", None)
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU processes even on a GPU machine
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", *NO_HOSTFILE, "--num_gpus", "2", "--master_port",
        str(_free_port()), "worker.py", "--flag",
        str(tmp_path)
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    records = {}
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as handle:
            records[rank] = json.load(handle)
    for rank, record in records.items():
        assert record["RANK"] == str(rank)
        assert record["WORLD_SIZE"] == "2"
        assert record["LOCAL_RANK"] == str(rank)
        assert record["local_rank_arg"] == [str(rank)]
        assert record["OMP_NUM_THREADS"] == "1"
        assert record["FROM_ENV_FILE"] == "yes"
