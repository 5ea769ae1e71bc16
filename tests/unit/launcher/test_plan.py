# SPDX-License-Identifier: Apache-2.0
"""The launch plan as pure functions: hostfile, filters, node and slot counts, world info, torchrun's arguments.

Expected values are written out by hand from the documented grammar and from torchrun's flags.
"""

import base64
import json
from collections import OrderedDict

import pytest

from deepspeed.launcher import launch, plan, runner

NO_HOSTFILE = ["--hostfile", "/nonexistent/hostfile"]


def write_hostfile(tmp_path, text):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def plan_for(argv, device_count=0, environ=None):
    return plan.plan_job(runner.parse_args(argv + ["train.py"]), device_count=device_count, environ=environ or {})


# ---- hostfile ------------------------------------------------------------------------------------------------


def test_hostfile_grammar():
    lines = [
        "# the workers\n", "\n", "worker-0 slots=4\n", "  worker-1   slots=2   # trailing comment\n", "w2 slots=1"
    ]
    assert plan.parse_hostfile(lines) == OrderedDict([("worker-0", 4), ("worker-1", 2), ("w2", 1)])
    assert list(plan.parse_hostfile(lines)) == ["worker-0", "worker-1", "w2"]


@pytest.mark.parametrize("text, match", [
    ("worker-0\n", "expected `hostname slots=N`"),
    ("worker-0 slots=x\n", "expected"),
    ("worker-0 slots=2 extra\n", "expected"),
    ("w slots=1\nw slots=2\n", "listed twice"),
    ("w slots=0\n", "positive"),
    ("# only a comment\n\n", "no hosts"),
])
def test_malformed_hostfile(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        plan.fetch_hostfile(write_hostfile(tmp_path, text))


def test_missing_hostfile_is_none():
    assert plan.fetch_hostfile("/nonexistent/hostfile") is None


# ---- include / exclude ---------------------------------------------------------------------------------------

# yapf: disable
FILTER_CASES = [
    ("", "", {"a": [0, 1, 2], "b": [0, 1]}),
    ("b", "", {"b": [0, 1]}),
    ("b:1@a:2,0", "", {"a": [0, 2], "b": [1]}),  # hostfile order, sorted slots
    ("a:1@a:0", "", {"a": [0, 1]}),  # a host named twice adds up
    ("", "a:1", {"a": [0, 2], "b": [0, 1]}),
    ("", "a@b:0", {"b": [1]}),
    ("", "b:0,1", {"a": [0, 1, 2]}),  # a host with no slot left is dropped
]
# yapf: enable


@pytest.mark.parametrize("include, exclude, expected", FILTER_CASES)
def test_inclusion_exclusion(include, exclude, expected):
    active = plan.parse_inclusion_exclusion({"a": 3, "b": 2}, include, exclude)
    assert dict(active) == expected
    assert list(active) == [host for host in ("a", "b") if host in expected]


@pytest.mark.parametrize("include, exclude", [("a", "b"), ("c", ""), ("a:3", ""), ("", "b:5"), ("a:x", ""),
                                              ("a@@b", "")])
def test_bad_filters(include, exclude):
    with pytest.raises(ValueError):
        plan.parse_inclusion_exclusion({"a": 3, "b": 2}, include, exclude)


def test_num_nodes_and_gpus():
    active = OrderedDict([("a", [0, 1, 2]), ("b", [0, 1, 2]), ("c", [0, 1, 2])])
    assert plan.apply_num_nodes_and_gpus(active, 2, -1) == OrderedDict([("a", [0, 1, 2]), ("b", [0, 1, 2])])
    assert plan.apply_num_nodes_and_gpus(active, -1, 1) == OrderedDict([("a", [0]), ("b", [0]), ("c", [0])])
    with pytest.raises(ValueError, match="more nodes"):
        plan.apply_num_nodes_and_gpus(active, 4, -1)
    with pytest.raises(ValueError, match="more slots"):
        plan.apply_num_nodes_and_gpus(active, -1, 4)


def test_world_info_encoding():
    info = OrderedDict([("worker-1", [0, 2]), ("worker-0", [1])])
    encoded = plan.encode_world_info(info)
    # upstream's encoding: URL-safe base64 of the JSON text
    assert json.loads(base64.urlsafe_b64decode(encoded)) == {"worker-1": [0, 2], "worker-0": [1]}
    assert list(plan.decode_world_info(encoded).items()) == list(info.items())
    assert runner.encode_world_info is plan.encode_world_info


# ---- the whole plan ------------------------------------------------------------------------------------------

THREE_HOSTS = "w0 slots=4\nw1 slots=4\nw2 slots=2\n"

# yapf: disable
PLAN_CASES = [
    # (argv, hostfile text, visible GPUs, environ) -> (hosts, master_addr, fan_out, node_rank)
    ([], None, 0, {}, ({"localhost": [0]}, "127.0.0.1", False, 0)),
    (["--num_gpus", "3"], None, 0, {}, ({"localhost": [0, 1, 2]}, "127.0.0.1", False, 0)),
    ([], None, 4, {}, ({"localhost": [0, 1, 2, 3]}, "127.0.0.1", False, 0)),
    (["--include", "localhost:1,3"], None, 4, {}, ({"localhost": [1, 3]}, "127.0.0.1", False, 0)),
    (["--exclude", "localhost:0"], None, 4, {}, ({"localhost": [1, 2, 3]}, "127.0.0.1", False, 0)),
    # CUDA_VISIBLE_DEVICES without a hostfile or filter: those devices are the slots (as upstream).
    ([], None, 2, {"CUDA_VISIBLE_DEVICES": "2,5"}, ({"localhost": [2, 5]}, "127.0.0.1", False, 0)),
    (["--num_gpus", "1"], None, 2, {"CUDA_VISIBLE_DEVICES": "2,5"}, ({"localhost": [0]}, "127.0.0.1", False, 0)),
    # Several identical nodes without a hostfile, one command per node.
    (["--num_nodes", "2", "--node_rank", "1", "--master_addr", "n0"], None, 0, {},
     ({"node0": [0], "node1": [0]}, "n0", False, 1)),
    # A hostfile: every node from here, master = first active host.
    ([], THREE_HOSTS, 0, {}, ({"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3], "w2": [0, 1]}, "w0", True, 0)),
    (["--exclude", "w0"], THREE_HOSTS, 0, {}, ({"w1": [0, 1, 2, 3], "w2": [0, 1]}, "w1", True, 0)),
    (["--include", "w1:1,2@w2"], THREE_HOSTS, 0, {}, ({"w1": [1, 2], "w2": [0, 1]}, "w1", True, 0)),
    (["--num_nodes", "2", "--num_gpus", "2", "--master_addr", "10.0.0.1"], THREE_HOSTS, 0, {},
     ({"w0": [0, 1], "w1": [0, 1]}, "10.0.0.1", True, 0)),
    (["--include", "w2"], THREE_HOSTS, 0, {}, ({"w2": [0, 1]}, "w2", False, 0)),  # one host: this node
    (["--include", "w2", "--force_multi"], THREE_HOSTS, 0, {}, ({"w2": [0, 1]}, "w2", True, 0)),
    # --no_ssh: this node only.
    (["--no_ssh", "--node_rank", "2"], THREE_HOSTS, 2, {},
     ({"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3], "w2": [0, 1]}, "w0", False, 2)),
]
# yapf: enable


@pytest.mark.parametrize("argv, hostfile, device_count, environ, expected", PLAN_CASES)
def test_plan(tmp_path, argv, hostfile, device_count, environ, expected):
    hostfile_argv = ["--hostfile", write_hostfile(tmp_path, hostfile)] if hostfile else NO_HOSTFILE
    job = plan_for(hostfile_argv + argv, device_count, environ)
    hosts, master_addr, fan_out, node_rank = expected
    assert (dict(job.hosts), job.master_addr, job.fan_out, job.node_rank) == (hosts, master_addr, fan_out, node_rank)
    assert job.devices_from_env == ("CUDA_VISIBLE_DEVICES" in environ and argv == [])


@pytest.mark.parametrize(
    "argv, hostfile, device_count",
    [
        (["--num_nodes", "2"], None, 0),  # no --node_rank and no hostfile
        (["--num_nodes", "2", "--node_rank", "1"], None, 0),  # no --master_addr
        (["--num_nodes", "2", "--node_rank", "2", "--master_addr", "a"], None, 0),
        (["--force_multi"], None, 0),
        (["--include", "localhost:0", "--exclude", "localhost:1"], None, 2),
        (["--include", "localhost:0", "--num_gpus", "1"], None, 2),
        (["--include", "localhost:5"], None, 2),
        (["--include", "otherhost"], None, 2),
        (["--num_gpus", "3"], None, 2),
        (["--num_gpus", "0"], None, 2),
        (["--no_ssh"], THREE_HOSTS, 0),  # which node?
        (["--no_ssh", "--node_rank", "3"], THREE_HOSTS, 0),
        (["--num_nodes", "4"], THREE_HOSTS, 0),
        (["--no_ssh", "--node_rank", "0"], THREE_HOSTS, 2),  # node 0 has 4 slots, this machine 2 GPUs
    ])
def test_invalid_plans(tmp_path, argv, hostfile, device_count):
    hostfile_argv = ["--hostfile", write_hostfile(tmp_path, hostfile)] if hostfile else NO_HOSTFILE
    with pytest.raises(ValueError):
        plan_for(hostfile_argv + argv, device_count)


@pytest.mark.parametrize("argv, error", [
    (["--autotuning", "tune"], NotImplementedError),
    (["--launcher", "nonesuch"], ValueError),
    (["--no_ssh", "--launcher", "slurm", "--node_rank", "0"], ValueError),
    (["--min_elastic_nodes", "2"], ValueError),
])
def test_refused_arguments(argv, error):
    with pytest.raises(error):
        runner.check_arguments(runner.parse_args(argv + ["train.py"]))


def test_module_and_no_python_conflict():
    with pytest.raises(SystemExit):
        runner.parse_args(["--module", "--no_python", "x"])


def test_launcher_options_after_the_script_belong_to_the_script():
    args = runner.parse_args(["--num_gpus", "2", "train.py", "--num_gpus", "7", "--launcher", "x"])
    assert (args.num_gpus, args.user_args) == (2, ["--num_gpus", "7", "--launcher", "x"])


# ---- the node agent's torchrun arguments ----------------------------------------------------------------------

LR = "--local_rank=${local_rank}"


def _agent_args(*argv):
    return launch.parse_args(["--world_info=x", "--master_addr=m", "--master_port=7", *argv])


# yapf: disable
TORCHRUN_CASES = [
    (["train.py", "--a"], 2, 1, 3,
     ["--nproc_per_node=3", "--nnodes=2", "--node_rank=1", "--master_addr=m", "--master_port=7", "train.py", LR,
      "--a"]),
    (["--no_local_rank", "--module", "pkg.train"], 1, 0, 1,
     ["--nproc_per_node=1", "--nnodes=1", "--node_rank=0", "--master_addr=m", "--master_port=7", "--module",
      "pkg.train"]),
    (["--no_python", "--no_local_rank", "bash", "run.sh"], 1, 0, 2,
     ["--nproc_per_node=2", "--nnodes=1", "--node_rank=0", "--master_addr=m", "--master_port=7", "--no_python",
      "bash", "run.sh"]),
    (["--enable_each_rank_log=/logs", "train.py"], 2, 0, 2,
     ["--nproc_per_node=2", "--nnodes=2", "--node_rank=0", "--master_addr=m", "--master_port=7", "--log_dir=/logs",
      "--redirects=3", "train.py", LR]),
    (["--elastic_training", "--min_elastic_nodes=1", "--job_id=j", "train.py"], 3, 2, 4,
     ["--nproc_per_node=4", "--nnodes=1:3", "--rdzv_backend=c10d", "--rdzv_endpoint=m:7", "--rdzv_id=j",
      f"--max_restarts={launch.ELASTIC_MAX_RESTARTS}", "train.py", LR]),
]
# yapf: enable


@pytest.mark.parametrize("argv, num_nodes, node_rank, nproc, expected", TORCHRUN_CASES)
def test_torchrun_argv(argv, num_nodes, node_rank, nproc, expected):
    assert launch.torchrun_argv(_agent_args(*argv), num_nodes, node_rank, nproc) == expected


def test_torchrun_argv_with_core_binding():
    argv = launch.torchrun_argv(_agent_args("--bind_cores_to_rank", "--bind_core_list=0-3", "--module", "pkg"), 1, 0,
                                2)
    assert argv[5:] == [
        "--no_python", launch.sys.executable, "-u", "-m", "deepspeed.launcher.core_binding", "--module",
        "--bind_core_list=0-3", "pkg", LR
    ]


def test_elastic_bounds():
    with pytest.raises(ValueError):
        launch.elastic_nnodes(_agent_args("--elastic_training", "--min_elastic_nodes=3", "--max_elastic_nodes=2", "x"),
                              2)


# yapf: disable
NODE_RANK_CASES = [
    ("openmpi", {"OMPI_COMM_WORLD_RANK": "1", "SLURM_NODEID": "0"}, 1),
    ("mpich", {"PMI_RANK": "2"}, 2),
    ("impi", {"PMIX_RANK": "1"}, 1),
    ("mvapich", {"MV2_COMM_WORLD_RANK": "1"}, 1),
    ("slurm", {"SLURMD_NODENAME": "w2", "SLURM_NODEID": "0"}, 2),  # by name: srun orders nodes its own way
    ("slurm", {"SLURM_NODEID": "1"}, 1),
]
# yapf: enable


@pytest.mark.parametrize("launcher, environ, expected", NODE_RANK_CASES)
def test_node_rank_from_environment(launcher, environ, expected):
    assert launch.node_rank_from_environment(launcher, ["w0", "w1", "w2"], environ) == expected


def test_node_rank_from_environment_missing():
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_RANK"):
        launch.node_rank_from_environment("openmpi", ["w0"], {})


# ---- devices and cores of one node ----------------------------------------------------------------------------


def test_visible_devices_of_a_node():
    assert launch._visible_devices([0, 2], {}) == "0,2"
    assert launch._visible_devices([0, 2], {"CUDA_VISIBLE_DEVICES": "4,5,7"}) == "4,7"  # slots index what is seen


def test_core_binding_shares():
    from deepspeed.launcher import core_binding
    assert core_binding.parse_range_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    cores = core_binding.parse_range_list("0-6")
    assert [core_binding.cores_for_rank(cores, rank, 3) for rank in range(3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError):
        core_binding.cores_for_rank([0, 1], 0, 3)
    with pytest.raises(ValueError):
        core_binding.parse_range_list("3-1")
    assert core_binding._script_command(["--module", "pkg", "--x"])[-4:] == ["-u", "-m", "pkg", "--x"]
    assert core_binding._script_command(["--no_python", "bash", "run.sh"]) == ["bash", "run.sh"]
