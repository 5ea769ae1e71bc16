# SPDX-License-Identifier: Apache-2.0
"""The ``deepspeed`` command: start a training script on one node or on every node of a hostfile.

``deepspeed [launcher options] user_script [user_args...]`` plans the job (``plan.plan_job``: hosts, slots,
rendezvous), then either runs this node's agent (one node, or ``--no_ssh --node_rank N`` on each node) or starts
an agent on every node through the chosen launcher (``multinode_runner``: pdsh, ssh, openmpi, mpich, impi, mvapich,
slurm) and supervises them (``controller.JobController``). Each agent (``deepspeed.launcher.launch``) runs torchrun
for its node, which sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` for every
process; unless ``--no_local_rank``, the script also receives ``--local_rank=<n>`` like upstream.

A failing rank stops every node and the command exits with the worst exit code, naming the node and rank that
failed first; Ctrl-C stops every node; over ssh and pdsh every host is checked before anything starts.
"""

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import List, Mapping, Optional, Sequence

from deepspeed.launcher.constants import PDSH_LAUNCHER, TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.launcher.controller import JobController
from deepspeed.launcher.environment import (DEEPSPEED_ENVIRONMENT_NAME, EXCLUDE_ENVS, EXPORT_ENVS,
                                            environment_file_paths, exported_environment, prepend_launch_dir,
                                            read_environment_files)
from deepspeed.launcher.multinode_runner import LAUNCHER_CLASSES, AgentOptions, node_agent_command
from deepspeed.launcher.constants import PDSH_MAX_FAN_OUT  # noqa: F401 (upstream's name here)
from deepspeed.launcher.plan import (DLTS_HOSTFILE, VISIBLE_DEVICES_ENV, JobPlan, apply_num_nodes_and_gpus,
                                     encode_world_info, fetch_hostfile, parse_hostfile, parse_inclusion_exclusion,
                                     parse_resource_filter, plan_job)
from deepspeed.launcher.ssh_runner import ssh_base_command

__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME", "DEEPSPEED_ENVIRONMENT_PATHS", "EXPORT_ENVS", "EXCLUDE_ENVS", "LAUNCHER_CLASSES",
    "PDSH_MAX_FAN_OUT", "DLTS_HOSTFILE", "encode_world_info", "fetch_hostfile", "parse_inclusion_exclusion",
    "parse_resource_filter", "apply_num_nodes_and_gpus", "parse_args", "main"
]

# Upstream's names for what now lives in plan.py and environment.py.
_parse_hostfile = parse_hostfile
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
CONTROLLER_ADDR_ENV = "DS_LAUNCHER_CONTROLLER_ADDR"
START_TIMEOUT_ENV = "DS_LAUNCHER_START_TIMEOUT"
DEFAULT_START_TIMEOUT_S = 600.0
# After `stop`, how long the nodes get to stop their workers before their transports are killed.
STOP_GRACE_S = 60.0
SSH_CHECK_TIMEOUT_S = 30.0
_LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def _log(message: str) -> None:
    print(f"[deepspeed launcher] {message}", file=sys.stderr, flush=True)


def parse_args(args: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the launcher's command line (``sys.argv[1:]`` when ``args`` is None); upstream's flags.

    Everything after ``user_script`` is passed to the script untouched (``user_args``).
    """
    parser = argparse.ArgumentParser(prog="deepspeed",
                                     description="Launch a DeepSpeed training script on one or several nodes.")
    parser.add_argument("-H",
                        "--hostfile",
                        type=str,
                        default=DLTS_HOSTFILE,
                        help="File with one `hostname slots=N` line per node. Missing file: this node only.")
    parser.add_argument("-i",
                        "--include",
                        type=str,
                        default="",
                        help="Resources to use, `NAME[:SLOT[,SLOT...]][@NAME...]`, e.g. `worker-0@worker-1:0,2`.")
    parser.add_argument("-e",
                        "--exclude",
                        type=str,
                        default="",
                        help="Resources to leave out, same format as --include.")
    parser.add_argument("--num_nodes", type=int, default=-1, help="Use the first N hosts of the hostfile.")
    parser.add_argument("--num_gpus",
                        "--num_accelerators",
                        dest="num_gpus",
                        type=int,
                        default=-1,
                        help="Processes per node: that many GPUs, or that many CPU processes on a machine without "
                        "CUDA (default: all visible GPUs, or 1 on CPU).")
    parser.add_argument("--master_port",
                        type=int,
                        default=TORCH_DISTRIBUTED_DEFAULT_PORT,
                        help="Port of the rendezvous on node 0.")
    parser.add_argument("--master_addr",
                        type=str,
                        default="",
                        help="Address of node 0 (default: 127.0.0.1 on one node, the first hostfile host otherwise).")
    parser.add_argument("--node_rank", type=int, default=-1, help="Index of this node, with --no_ssh.")
    parser.add_argument("--launcher",
                        type=str,
                        default=PDSH_LAUNCHER,
                        help=f"How to start the nodes: {', '.join(LAUNCHER_CLASSES)}.")
    parser.add_argument("--launcher_args",
                        type=str,
                        default="",
                        help="Arguments for the launcher program (pdsh, ssh, mpirun, srun), as one quoted string.")
    parser.add_argument("--module", action="store_true", help="Run user_script as a Python module, like `python -m`.")
    parser.add_argument("--no_python",
                        action="store_true",
                        help="Execute user_script directly instead of through the Python interpreter.")
    parser.add_argument("--no_local_rank",
                        action="store_true",
                        help="Do not pass --local_rank=<n> to the script (LOCAL_RANK is set in any case).")
    parser.add_argument("--no_ssh",
                        action="store_true",
                        help="Run only this node (--node_rank); start the same command on every node.")
    parser.add_argument("--no_ssh_check", action="store_true", help="Skip the check that every host answers ssh.")
    parser.add_argument("--force_multi",
                        action="store_true",
                        help="Start the nodes through the launcher even when there is only one.")
    parser.add_argument("--save_pid",
                        action="store_true",
                        help="Each node agent writes its pid to /tmp/<pid of this command>.deepspeed.")
    parser.add_argument("--enable_each_rank_log",
                        type=str,
                        default="None",
                        help="Directory for each rank's stdout and stderr.")
    parser.add_argument("--autotuning", type=str, default="", choices=["", "tune", "run"], help="Not supported.")
    parser.add_argument("--bind_cores_to_rank", action="store_true", help="Give each rank its share of the cores.")
    parser.add_argument("--bind_core_list", type=str, default=None, help="Cores to share, e.g. 0-7,16-23.")
    parser.add_argument("--ssh_port", type=int, default=None, help="ssh port of the hosts (ssh and pdsh).")
    parser.add_argument("--venv_script", type=str, default=None, help="Script every node sources first.")
    parser.add_argument("--elastic_training",
                        action="store_true",
                        help="torch elastic's c10d rendezvous: nodes may join and leave between restarts.")
    parser.add_argument("--min_elastic_nodes", type=int, default=-1, help="Elastic: fewest nodes (default: all).")
    parser.add_argument("--max_elastic_nodes", type=int, default=-1, help="Elastic: most nodes (default: all).")
    parser.add_argument("--log_level",
                        type=str,
                        default="info",
                        choices=["debug", "info", "warning", "error", "critical"],
                        help="Verbosity of the launcher's own messages.")
    parser.add_argument("-q", "--quiet", action="store_true", help="Alias of --log_level error.")
    parser.add_argument("user_script", type=str, help="Training script (or module / executable) to run.")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="Arguments for user_script.")
    parsed = parser.parse_args(args)
    if parsed.module and parsed.no_python:
        parser.error("--module and --no_python cannot be used together")
    parsed.launcher = parsed.launcher.lower()
    if parsed.quiet:
        parsed.log_level = "error"
    return parsed


def check_arguments(args: argparse.Namespace) -> None:
    """Requests no launcher can carry out, refused before anything is planned."""
    if args.autotuning:
        raise NotImplementedError("--autotuning (upstream's autotuner) is not implemented")
    if args.launcher not in LAUNCHER_CLASSES:
        raise ValueError(f"unknown --launcher {args.launcher!r}; choose one of {', '.join(LAUNCHER_CLASSES)}")
    if args.no_ssh and args.launcher != PDSH_LAUNCHER:
        raise ValueError(f"--no_ssh runs this node only, --launcher {args.launcher} starts every node: choose one")
    if not args.elastic_training and (args.min_elastic_nodes > 0 or args.max_elastic_nodes > 0):
        raise ValueError("--min_elastic_nodes/--max_elastic_nodes need --elastic_training")


def local_environment(plan: JobPlan,
                      base_env: Mapping[str, str],
                      file_env: Optional[Mapping[str, str]] = None,
                      cwd: Optional[str] = None) -> dict:
    """The environment of this node's agent: ``base_env``, the ``.deepspeed_env`` values, the launch directory
    first on ``PYTHONPATH``; without ``CUDA_VISIBLE_DEVICES`` when the plan took its slots from it."""
    env = dict(base_env)
    env.update(file_env or {})
    env["PYTHONPATH"] = prepend_launch_dir(env.get("PYTHONPATH"), cwd or os.getcwd())
    if plan.devices_from_env:
        env.pop(VISIBLE_DEVICES_ENV, None)
    return env


def local_command(args: argparse.Namespace, plan: JobPlan, python: Optional[str] = None) -> List[str]:
    """The node agent's argv for this node (one-node jobs and ``--no_ssh``)."""
    options = AgentOptions(python=python or "", save_pid=os.getpid() if args.save_pid else 0)
    return node_agent_command(args, plan, options, str(plan.node_rank))


def run_command(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``cmd`` to completion and return its exit status.

    The child runs in its own session, so a terminal's Ctrl-C reaches it once, through this process: SIGINT,
    SIGTERM and SIGHUP received here are forwarded to it and the launcher keeps waiting for it to exit. The status
    is the child's own, except 128 + N when the child died of signal N.
    """
    child = subprocess.Popen(list(cmd), env=dict(env), start_new_session=True)

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    with _signals_handled(forward):
        returncode = child.wait()
    return 128 - returncode if returncode < 0 else returncode


class _signals_handled:
    """Install ``handler`` for the forwarded signals while inside (main thread only; elsewhere a no-op)."""

    def __init__(self, handler):
        self.handler, self.previous = handler, {}

    def __enter__(self):
        try:
            for signum in FORWARDED_SIGNALS:
                self.previous[signum] = signal.signal(signum, self.handler)
        except ValueError:
            pass  # not the main thread: signals cannot be caught here
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def _all_local(hosts: Sequence[str]) -> bool:
    names = set(_LOCAL_NAMES) | {socket.gethostname()}
    return all(host in names or host.startswith("127.") for host in hosts)


def controller_address(hosts: Sequence[str], environ: Mapping[str, str]) -> tuple:
    """(bind address, address the nodes are told) of the controller."""
    if environ.get(CONTROLLER_ADDR_ENV):
        return "", environ[CONTROLLER_ADDR_ENV]
    if _all_local(hosts):
        return "127.0.0.1", "127.0.0.1"
    return "", socket.gethostname()


def ssh_preflight(hosts: Sequence[str], ssh_port: Optional[int], ssh_args: Sequence[str] = ()) -> None:
    """Check, in parallel, that every host answers a password-less ssh; RuntimeError naming those that do not.

    ``ssh_args`` are the options the launch itself will give ssh (a key, a user), so the check asks what the
    launch will.
    """
    base = ssh_base_command(ssh_port, ["-o", "PasswordAuthentication=no", "-o", "ConnectTimeout=10", *ssh_args])
    checks = [(host,
               subprocess.Popen(base + [host, "hostname"],
                                stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE,
                                text=True)) for host in hosts]
    unreachable = []
    for host, check in checks:
        try:
            _, err = check.communicate(timeout=SSH_CHECK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            check.kill()
            _, err = check.communicate()
            err = f"no answer within {SSH_CHECK_TIMEOUT_S:.0f} s"
        if check.returncode != 0:
            last = (err or "").strip().splitlines()
            unreachable.append(f"{host} ({last[-1] if last else f'ssh exited {check.returncode}'})")
    if unreachable:
        raise RuntimeError(f"not reachable over password-less ssh: {', '.join(unreachable)}. Nothing was started. "
                           "Set up ssh keys for these hosts, fix the hostfile, or pass --no_ssh_check to skip "
                           "this check")


def _stop_transport(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def supervise(plan: JobPlan, runner, controller: JobController, options: AgentOptions, environ) -> int:
    """Start the transports and wait for every node; return the job's exit status (see the module doc)."""
    start_timeout = float(environ.get(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT_S))
    transports = runner.transports(plan, options, environ)
    interrupted: List[int] = []

    def on_signal(signum, _frame):
        # Only noted here: the wait loop tells the nodes, outside whatever controller call this interrupted.
        if interrupted:  # a second Ctrl-C: do not wait for the nodes any longer
            for _, process in running:
                _stop_transport(process, signal.SIGKILL)
        interrupted.append(signum)

    running = []
    with _signals_handled(on_signal):
        for transport in transports:
            _log(f"{transport.label}: {' '.join(transport.argv)}")
            running.append((transport, subprocess.Popen(transport.argv, env=transport.env, start_new_session=True)))
        started = time.monotonic()
        stop_since = None
        pending = list(running)
        while pending:
            if interrupted and not controller.stopping:
                controller.stop_all()
            controller.poll(0.2)
            for transport, process in list(pending):
                if process.poll() is None:
                    continue
                pending.remove((transport, process))
                # What the node said before its transport ended is read first: it knows why.
                controller.poll(0.1)
                if process.returncode != 0:
                    code = 128 - process.returncode if process.returncode < 0 else process.returncode
                    controller.record_transport_failure(transport.node, code,
                                                        f"{transport.label} exited with code {code}")
            now = time.monotonic()
            if not controller.stopping and not controller.all_connected() and now - started > start_timeout:
                missing = [i for i, report in controller.nodes.items() if not report.connected]
                controller.record_transport_failure(missing[0], 1,
                                                    f"its node agent did not connect within {start_timeout:.0f} s")
            if controller.stopping and stop_since is None:
                stop_since = now
                # A transport whose node agent never connected has nothing to stop gracefully.
                for transport, process in pending:
                    if transport.node is not None and not controller.nodes[transport.node].connected:
                        _stop_transport(process, signal.SIGTERM)
            if stop_since is not None and now - stop_since > STOP_GRACE_S:
                for _, process in pending:
                    _stop_transport(process, signal.SIGKILL)
        controller.poll(0.1)
        if not interrupted:
            # Every transport ended; a node that never said how its workers ended did not run them.
            for index, report in controller.nodes.items():
                if report.exit_code is None:
                    controller.record_transport_failure(index, 1, "its node agent never reported")

    failure = controller.first_failure()
    if failure is not None:
        _log(f"{failure.describe()}; every node was stopped")
        return controller.worst_exit_code()
    if interrupted:
        _log(f"stopped every node on signal {interrupted[0]}")
        return 128 + interrupted[0]
    codes = [process.returncode for _, process in running]
    return next((code for code in codes if code != 0), 0)


def launch_all_nodes(args: argparse.Namespace, plan: JobPlan, environ: Mapping[str, str]) -> int:
    """Start every node of ``plan`` through ``args.launcher`` and supervise them."""
    runner_cls = LAUNCHER_CLASSES[args.launcher]
    world_info = encode_world_info(plan.hosts)
    runner = runner_cls(args, world_info)
    if not runner.backend_exists():
        raise RuntimeError(f"launcher {args.launcher!r} is not installed on this node (its program is not on PATH)" +
                           ("; --launcher ssh needs only ssh" if args.launcher == PDSH_LAUNCHER else ""))
    cwd = os.path.abspath(".")
    from deepspeed.accelerator import get_accelerator
    exports = exported_environment(environ, cwd, read_environment_files(environment_file_paths(environ=environ)),
                                   get_accelerator().export_envs())
    for key, value in exports.items():
        runner.add_export(key, value)
    if runner.uses_ssh and not args.no_ssh_check:
        # ssh's own options: --launcher_args for the ssh launcher, PDSH_SSH_ARGS_APPEND for pdsh's ssh.
        ssh_args = runner.launcher_args() if args.launcher == "ssh" else shlex.split(
            environ.get("PDSH_SSH_ARGS_APPEND", ""))
        ssh_preflight(list(plan.hosts), args.ssh_port, ssh_args)
    runner.prepare(plan)
    bind_addr, advertised = controller_address(list(plan.hosts), environ)
    controller = JobController(list(plan.hosts), bind_addr=bind_addr)
    options = AgentOptions(controller=f"{advertised}:{controller.port}",
                           job_token=controller.token,
                           launch_dir=cwd,
                           save_pid=os.getpid() if args.save_pid else 0)
    _log(f"{plan.num_nodes} nodes, {plan.world_size} processes: {dict(plan.hosts)}")
    try:
        return supervise(plan, runner, controller, options, environ)
    finally:
        controller.close()


def _cuda_device_count() -> int:
    """Number of CUDA devices this process can see (0 without CUDA)."""
    import torch

    # device_count() asks NVML where it can and does not initialise CUDA in the launcher.
    return torch.cuda.device_count()


def main(args: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``deepspeed`` command; returns the exit status of the launched job."""
    parsed = parse_args(args)
    check_arguments(parsed)
    if fetch_hostfile(parsed.hostfile) is None and parsed.hostfile != DLTS_HOSTFILE:
        _log(f"hostfile {parsed.hostfile} not found; using this node only")
    plan = plan_job(parsed, device_count=_cuda_device_count())
    if plan.fan_out:
        return launch_all_nodes(parsed, plan, os.environ)
    env = local_environment(plan, os.environ, read_environment_files(environment_file_paths()))
    cmd = local_command(parsed, plan)
    _log(f"node {plan.node_rank}/{plan.num_nodes}, {len(list(plan.hosts.values())[plan.node_rank])} processes: "
         f"{' '.join(cmd)}")
    return run_command(cmd, env)


if __name__ == "__main__":
    sys.exit(main())
