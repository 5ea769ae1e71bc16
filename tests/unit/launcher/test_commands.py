# SPDX-License-Identifier: Apache-2.0
"""Every launcher's command line for a table of hostfiles and flags, written out by hand from the programs'
documented options (pdsh, ssh, Open MPI's and Hydra's mpirun, MVAPICH, srun); and the one-node command."""

import os
import shlex
import subprocess
from collections import OrderedDict

import pytest

from deepspeed.launcher import multinode_runner, plan, runner
from deepspeed.launcher.constants import MVAPICH_TMP_HOSTFILE
from deepspeed.launcher.multinode_runner import LAUNCHER_CLASSES, AgentOptions

HOSTS = "w0 slots=2\nw1 slots=2\nw2 slots=1\n"
OPTIONS = AgentOptions(controller="head:5000", job_token="tok", launch_dir="/job dir", python="PY")
EXPORTS = OrderedDict([("NCCL_X", "a b"), ("PYTHONPATH", "/job dir")])
MV2_DEFAULTS = [("MV2_SMP_USE_CMA", "0"), ("MV2_DEBUG_SHOW_BACKTRACE", "1"), ("MV2_SUPPORT_DL", "1"),
                ("MV2_ENABLE_AFFINITY", "0"), ("MV2_INTER_ALLGATHER_TUNING", "5"), ("MV2_CUDA_USE_NAIVE", "0")]


def build(tmp_path, launcher, *argv):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(HOSTS)
    args = runner.parse_args(["--hostfile", str(hostfile), "--launcher", launcher, *argv, "train.py", "--lr", "0.1"])
    job = plan.plan_job(args, device_count=0, environ={})
    launcher_obj = LAUNCHER_CLASSES[launcher](args, plan.encode_world_info(job.hosts))
    for key, value in EXPORTS.items():
        launcher_obj.add_export(key, value)
    return launcher_obj, job, launcher_obj.transports(job, OPTIONS, {"BASE": "1"})


def agent(job, node_rank, launcher, *flags):
    return [
        "PY", "-u", "-m", "deepspeed.launcher.launch", f"--world_info={plan.encode_world_info(job.hosts)}",
        f"--node_rank={node_rank}", f"--master_addr={job.master_addr}", "--master_port=29500",
        f"--launcher={launcher}", "--controller=head:5000", "--job_token=tok", *flags, "train.py", "--lr", "0.1"
    ]


def shell(job, node_rank, launcher, *flags, venv=None):
    exports = "export NCCL_X='a b'; export PYTHONPATH='/job dir'; cd '/job dir'; "
    source = f"source {venv}; " if venv else ""
    return exports + source + " ".join(shlex.quote(w) for w in agent(job, node_rank, launcher, *flags))


def test_pdsh(tmp_path):
    _, job, (transport, ) = build(tmp_path, "pdsh", "--launcher_args", "-l admin", "--ssh_port", "2222")
    assert transport.argv == ["pdsh", "-S", "-f", "1024", "-w", "w0,w1,w2", "-l", "admin", shell(job, "%n", "pdsh")]
    assert transport.env["PDSH_RCMD_TYPE"] == "ssh"
    assert transport.env["PDSH_SSH_ARGS_APPEND"] == "-p 2222"
    assert transport.env["BASE"] == "1" and transport.node is None


def test_ssh(tmp_path):
    _, job, transports = build(tmp_path, "ssh", "--ssh_port", "2222", "--launcher_args=-i key")
    assert [t.argv for t in transports
            ] == [["ssh", "-o", "BatchMode=yes", "-p", "2222", "-i", "key", host,
                   shell(job, str(i), "ssh")] for i, host in enumerate(["w0", "w1", "w2"])]
    assert [t.node for t in transports] == [0, 1, 2]


def test_openmpi(tmp_path):
    _, job, (transport, ) = build(tmp_path, "openmpi", "--launcher_args", "--mca btl_tcp_if_include ib0")
    assert transport.argv == [
        "mpirun", "-n", "3", "--host", "w0,w1,w2", "--map-by", "ppr:1:node", "--mca", "btl_tcp_if_include", "ib0",
        "-x", "NCCL_X=a b", "-x", "PYTHONPATH=/job dir"
    ] + agent(job, "-1", "openmpi")


@pytest.mark.parametrize("launcher", ["mpich", "impi"])
def test_hydra(tmp_path, launcher):
    _, job, (transport, ) = build(tmp_path, launcher, "--include", "w0:1@w2")
    pin = ["-genv", "I_MPI_PIN", "0"] if launcher == "impi" else []
    assert transport.argv == [
        "mpirun", "-n", "2", "-ppn", "1", "-hosts", "w0,w2", "-genv", "NCCL_X", "a b", "-genv", "PYTHONPATH",
        "/job dir"
    ] + pin + agent(job, "-1", launcher)
    assert dict(job.hosts) == {"w0": [1], "w2": [0]}  # the agents narrow the devices, so the filter holds


def test_mvapich(tmp_path):
    launcher, job, (transport, ) = build(tmp_path, "mvapich", "--num_gpus", "1")
    exports = []
    for key, value in MV2_DEFAULTS + list(EXPORTS.items()):
        exports += ["-env", f"{key}={value}"]
    assert transport.argv == ["mpirun", "-np", "3", "-ppn", "1", "--hostfile", MVAPICH_TMP_HOSTFILE] + exports + agent(
        job, "-1", "mvapich")


def test_slurm(tmp_path):
    _, job, (transport, ) = build(tmp_path, "slurm", "--exclude", "w1", "--launcher_args", "-p gpu")
    assert transport.argv == [
        "srun", "-n", "2", "--ntasks-per-node=1", "--nodes=2", "--nodelist=w0,w2", "--kill-on-bad-exit=1", "-p", "gpu",
        "--export=ALL"
    ] + agent(job, "-1", "slurm")
    # srun's own environment carries the exports (--export=ALL): no comma can split a value.
    assert transport.env["NCCL_X"] == "a b" and transport.env["BASE"] == "1"


def test_venv_script(tmp_path):
    _, job, (transport, ) = build(tmp_path, "pdsh", "--venv_script", "/v/activate")
    assert transport.argv[-1] == shell(job, "%n", "pdsh", venv="/v/activate")
    _, job, (transport, ) = build(tmp_path, "slurm", "--venv_script", "/v/activate")
    assert transport.argv[transport.argv.index("--export=ALL") +
                          1:] == ["bash", "-c", 'source /v/activate && exec "$@"', "bash"] + agent(job, "-1", "slurm")


def test_agent_flags(tmp_path):
    args = [
        "--module", "--no_local_rank", "--enable_each_rank_log", "/logs", "--bind_cores_to_rank", "--bind_core_list",
        "0-3", "--elastic_training", "--max_elastic_nodes", "4"
    ]
    _, job, (transport, ) = build(tmp_path, "openmpi", *args)
    flags = [
        "--module", "--no_local_rank", "--enable_each_rank_log=/logs", "--bind_cores_to_rank", "--bind_core_list=0-3",
        "--elastic_training", "--min_elastic_nodes=-1", "--max_elastic_nodes=4", "--job_id=tok"
    ]
    assert transport.argv[-len(agent(job, "-1", "openmpi", *flags)):] == agent(job, "-1", "openmpi", *flags)


@pytest.mark.parametrize("launcher", ["openmpi", "mpich", "impi", "mvapich", "slurm"])
def test_ssh_port_is_refused_where_it_cannot_apply(tmp_path, launcher):
    with pytest.raises(ValueError, match="--ssh_port"):
        build(tmp_path, launcher, "--ssh_port", "2222")


def test_shell_command_keeps_values_and_arguments_intact(tmp_path):
    """What the remote shell sees: the exported value and every argument arrive as written."""
    tricky = "a b (c) $HOME 'q' \"d\" `e` ;f"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(HOSTS)
    args = runner.parse_args(["--hostfile", str(hostfile), "train.py", tricky, "--x=$(id)"])
    job = plan.plan_job(args, device_count=0, environ={})
    launcher = LAUNCHER_CLASSES["pdsh"](args, plan.encode_world_info(job.hosts))
    launcher.add_export("V", tricky)
    command = launcher.remote_shell_command(job, AgentOptions(launch_dir=str(tmp_path), python="PY"), "%n")
    agent_part = command.split(f"cd {tmp_path}; ", 1)[1]
    assert shlex.split(agent_part)[-3:] == ["train.py", tricky, "--x=$(id)"]
    exports = command.split(" cd ", 1)[0]
    printed = subprocess.run(["sh", "-c", exports + ' printf "%s" "$V"'], capture_output=True, text=True, env={})
    assert printed.stdout == tricky


def test_mvapich_hostfile(tmp_path, monkeypatch):
    path = tmp_path / "mv2hosts"
    monkeypatch.setattr("deepspeed.launcher.mpi_runners.MVAPICH_TMP_HOSTFILE", str(path))
    launcher, job, _ = build(tmp_path, "mvapich")
    launcher.prepare(job)
    assert path.read_text() == "w0\nw1\nw2\n"


# ---- one node ------------------------------------------------------------------------------------------------


def test_local_command_and_environment(tmp_path):
    args = runner.parse_args(["--hostfile", "/nonexistent", "--num_gpus", "2", "--save_pid", "train.py", "--a"])
    job = plan.plan_job(args, device_count=0, environ={})
    cmd = runner.local_command(args, job, python="PY")
    assert cmd == [
        "PY", "-u", "-m", "deepspeed.launcher.launch", f"--world_info={plan.encode_world_info({'localhost': [0, 1]})}",
        "--node_rank=0", "--master_addr=127.0.0.1", "--master_port=29500", f"--save_pid={os.getpid()}", "train.py",
        "--a"
    ]
    env = runner.local_environment(job, {"PYTHONPATH": "/lib", "A": "shell"}, {"A": "file"}, cwd="/launch")
    assert (env["PYTHONPATH"], env["A"]) == ("/launch" + os.pathsep + "/lib", "file")
    from_env = plan.plan_job(runner.parse_args(["--hostfile", "/nonexistent", "x.py"]), 4,
                             {"CUDA_VISIBLE_DEVICES": "1"})
    assert "CUDA_VISIBLE_DEVICES" not in runner.local_environment(from_env, {"CUDA_VISIBLE_DEVICES": "1"}, cwd="/")


def test_upstream_names():
    for name in ("PDSHRunner", "OpenMPIRunner", "MPICHRunner", "IMPIRunner", "MVAPICHRunner", "SlurmRunner"):
        assert issubclass(getattr(multinode_runner, name), multinode_runner.MultiNodeRunner)
    assert list(LAUNCHER_CLASSES) == ["pdsh", "ssh", "openmpi", "mpich", "impi", "mvapich", "slurm"]


@pytest.mark.parametrize("launcher", ["pdsh", "openmpi", "mpich", "mvapich", "slurm", "ssh"])
def test_get_cmd_is_the_transports_of_the_given_hosts(tmp_path, monkeypatch, launcher):
    """Upstream's runner interface: construct with (args, world info[, resource pool]) and ask ``get_cmd(env,
    active_resources)`` (slot counts or slot ids): the same argv the launcher starts for a plan of those hosts."""
    monkeypatch.setattr("deepspeed.launcher.mpi_runners.MVAPICH_TMP_HOSTFILE", str(tmp_path / "mv2hosts"))
    monkeypatch.chdir(tmp_path)
    args = runner.parse_args(["--launcher", launcher, "train.py", "--lr", "0.1"])
    pool = OrderedDict([("w0", 2), ("w1", [0, 3])])
    world_info = plan.encode_world_info(pool)
    launcher_obj = LAUNCHER_CLASSES[launcher](args, world_info, pool)
    assert launcher_obj.resource_pool is pool
    job = plan.JobPlan(OrderedDict([("w0", [0, 1]), ("w1", [0, 3])]), "w0", 29500, True, 0)
    expected = [t.argv for t in launcher_obj.transports(job, AgentOptions(launch_dir=str(tmp_path)), {"B": "1"})]
    got = launcher_obj.get_cmd({"B": "1"}, pool)
    if launcher == "pdsh":
        cmd, kill, env = got
        assert (cmd, env["PDSH_RCMD_TYPE"], env["B"]) == (expected[0], "ssh", "1")
        assert kill[:6] == ["pdsh", "-S", "-f", "1024", "-w", "w0,w1"]
        assert kill[6] == f"pkill -f -- --world_info={world_info}"
    else:
        assert got == (expected[0] if len(expected) == 1 else expected)
    assert f"--world_info={world_info}" in " ".join(expected[0])
    if launcher == "mvapich":  # written by get_cmd, as upstream's
        assert (tmp_path / "mv2hosts").read_text() == "w0\nw1\n"


def test_runner_written_against_upstreams_interface_constructs():
    """A subclass defining upstream's abstract methods only (``backend_exists``, ``get_cmd``) constructs, also
    with arguments that lack this launcher's flags; it cannot start agents."""

    class Custom(multinode_runner.MultiNodeRunner):

        def backend_exists(self):
            return True

        def get_cmd(self, environment, active_resources):
            return ["custom"]

    from types import SimpleNamespace
    custom = Custom(SimpleNamespace(user_args=[], user_script="x.py"), "info")
    custom.add_export("PYTHONPATH", "/lib")
    assert custom.exports["PYTHONPATH"] == "/lib" and custom.get_cmd({}, {}) == ["custom"]
    with pytest.raises(NotImplementedError, match="transports"):
        custom.transports(None, AgentOptions(), {})
