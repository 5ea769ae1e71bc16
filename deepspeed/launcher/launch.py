# SPDX-License-Identifier: Apache-2.0
"""The node agent: runs one node's share of a job through torchrun (``torch.distributed.run``).

``python -m deepspeed.launcher.launch --world_info=<b64> --node_rank=N --master_addr=A --master_port=P script ...``
(upstream's flags) decodes the world info (``{host: [slot ids]}``, see ``plan.encode_world_info``), takes the slots
of host ``N`` and runs torchrun with a static rendezvous at ``A:P`` (``nnodes`` = hosts, ``node_rank`` = N,
``nproc_per_node`` = this host's slots), in this process, so that the exit code and rank of a failed worker are
known here and not collapsed into torchrun's exit status 1. Every node runs the same agent, however it was
started; ``--node_rank=-1`` reads the node's index from the launcher that started it (``--launcher``).

With ``--controller`` the agent reports to the ``deepspeed`` command that started it (``controller.py``) and stops
its workers when told to. It exits with the exit code of the first worker that failed (128 + N for a signal N)
after naming the node and rank on stderr.
"""

import argparse
import os
import signal
import socket
import sys
import threading
from typing import List, Mapping, Optional, Sequence

from deepspeed.launcher.constants import (ELASTIC_TRAINING_ID_DEFAULT, IMPI_LAUNCHER, MPICH_LAUNCHER, MVAPICH_LAUNCHER,
                                          OPENMPI_LAUNCHER, SLURM_LAUNCHER, TORCH_DISTRIBUTED_DEFAULT_PORT)
from deepspeed.launcher.controller import STOPPED_EXIT_CODE, ControllerLink
from deepspeed.launcher.plan import VISIBLE_DEVICES_ENV, decode_world_info

PID_FILE_BASEPATH = "/tmp"
LOCAL_RANK_MACRO = "${local_rank}"
ELASTIC_MAX_RESTARTS = 3
# How long a requested stop may take before the agent stops itself (see ``request_stop``), with workers
# running (torchrun gives them 30 s after SIGTERM) and without.
HARD_STOP_AFTER_S = 60.0
HARD_STOP_IDLE_AFTER_S = 2.0
# Where each launcher puts the index of the task (one task per node): the node's index.
NODE_RANK_ENVS = {
    OPENMPI_LAUNCHER: ("OMPI_COMM_WORLD_RANK", ),
    MPICH_LAUNCHER: ("PMI_RANK", "PMIX_RANK"),
    IMPI_LAUNCHER: ("PMI_RANK", "PMIX_RANK"),
    MVAPICH_LAUNCHER: ("MV2_COMM_WORLD_RANK", "PMI_RANK"),
    SLURM_LAUNCHER: ("SLURM_NODEID", "SLURM_PROCID"),
}


def parse_args(args: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m deepspeed.launcher.launch",
                                     description="Run this node's processes of a DeepSpeed job through torchrun.")
    parser.add_argument("--node_rank", type=int, default=0, help="Index of this node; -1: from the launcher.")
    parser.add_argument("--master_addr", type=str, default="127.0.0.1", help="Address of node 0.")
    parser.add_argument("--master_port", type=int, default=TORCH_DISTRIBUTED_DEFAULT_PORT, help="Rendezvous port.")
    parser.add_argument("--world_info", type=str, default="None", help="Base64 JSON {host: [slot ids]}.")
    parser.add_argument("--module", action="store_true", help="Run the script as a module (python -m).")
    parser.add_argument("--no_python", action="store_true", help="Execute the script directly.")
    parser.add_argument("--no_local_rank", action="store_true", help="Do not pass --local_rank to the script.")
    parser.add_argument("--save_pid", type=int, default=0, help="Write this agent's pid to /tmp/<N>.deepspeed.")
    parser.add_argument("--enable_each_rank_log",
                        type=str,
                        default="None",
                        help="Directory for each rank's stdout/stderr (torchrun's log layout).")
    parser.add_argument("--bind_cores_to_rank", action="store_true", help="Give each rank its share of cores.")
    parser.add_argument("--bind_core_list", type=str, default=None, help="Cores to share, e.g. 0-7,16.")
    parser.add_argument("--log_level", type=str, default="info", help="Accepted as upstream.")
    parser.add_argument("-q", "--quiet", action="store_true", help="Accepted as upstream.")
    parser.add_argument("--launcher", type=str, default="", help="Who started this node (for --node_rank=-1).")
    parser.add_argument("--controller", type=str, default="", help="host:port of the deepspeed command.")
    parser.add_argument("--job_token", type=str, default="", help="The job's token for the controller.")
    parser.add_argument("--elastic_training", action="store_true", help="torch elastic's c10d rendezvous.")
    parser.add_argument("--min_elastic_nodes", type=int, default=-1)
    parser.add_argument("--max_elastic_nodes", type=int, default=-1)
    parser.add_argument("--job_id", type=str, default=ELASTIC_TRAINING_ID_DEFAULT, help="Elastic rendezvous id.")
    parser.add_argument("training_script", type=str)
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    parsed = parser.parse_args(args)
    if parsed.module and parsed.no_python:
        parser.error("--module and --no_python cannot be used together")
    return parsed


def node_rank_from_environment(launcher: str, hosts: Sequence[str], environ: Mapping[str, str]) -> int:
    """This node's index when the launcher (one task per node) chose it.

    Under Slurm the node is found by name (``SLURMD_NODENAME`` among the hosts), since srun orders nodes its own
    way; otherwise the task index the launcher exports (``NODE_RANK_ENVS``).
    """
    if launcher == SLURM_LAUNCHER and environ.get("SLURMD_NODENAME") in hosts:
        return list(hosts).index(environ["SLURMD_NODENAME"])
    for name in NODE_RANK_ENVS.get(launcher, ()):
        if environ.get(name, "") != "":
            return int(environ[name])
    raise ValueError(f"--node_rank=-1 needs the node index from the {launcher or 'unnamed'} launcher "
                     f"({', '.join(NODE_RANK_ENVS.get(launcher, ())) or 'no variable known'}), which is not set")


def elastic_nnodes(args: argparse.Namespace, num_nodes: int) -> str:
    low = args.min_elastic_nodes if args.min_elastic_nodes > 0 else num_nodes
    high = args.max_elastic_nodes if args.max_elastic_nodes > 0 else num_nodes
    if not 0 < low <= high:
        raise ValueError(f"--min_elastic_nodes {low} must be positive and at most --max_elastic_nodes {high}")
    return f"{low}:{high}"


def torchrun_argv(args: argparse.Namespace, num_nodes: int, node_rank: int, nproc: int) -> List[str]:
    """torchrun's arguments for this node (``python -m torch.distributed.run <these>``)."""
    argv = [f"--nproc_per_node={nproc}"]
    if args.elastic_training:
        argv += [
            f"--nnodes={elastic_nnodes(args, num_nodes)}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={args.master_addr}:{args.master_port}", f"--rdzv_id={args.job_id}",
            f"--max_restarts={ELASTIC_MAX_RESTARTS}"
        ]
    else:
        argv += [
            f"--nnodes={num_nodes}", f"--node_rank={node_rank}", f"--master_addr={args.master_addr}",
            f"--master_port={args.master_port}"
        ]
    if args.enable_each_rank_log != "None":
        argv += [f"--log_dir={args.enable_each_rank_log}", "--redirects=3"]
    script = [args.training_script] + ([] if args.no_local_rank else [f"--local_rank={LOCAL_RANK_MACRO}"])
    script += list(args.training_script_args)
    if args.bind_cores_to_rank:
        # Each worker binds itself, then becomes the script (see core_binding.py).
        inner = ["--module"] if args.module else ["--no_python"] if args.no_python else []
        if args.bind_core_list:
            inner.append(f"--bind_core_list={args.bind_core_list}")
        return argv + ["--no_python", sys.executable, "-u", "-m", "deepspeed.launcher.core_binding"] + inner + script
    if args.module:
        argv.append("--module")
    if args.no_python:
        argv.append("--no_python")
    return argv + script


def _visible_devices(slots: Sequence[int], environ: Mapping[str, str]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for these slots, which index the devices this node already sees."""
    visible = environ.get(VISIBLE_DEVICES_ENV, "")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible.strip() else None
    return ",".join(ids[slot] if ids is not None and slot < len(ids) else str(slot) for slot in slots)


def _cuda_device_count() -> int:
    import torch
    return torch.cuda.device_count()


def _caused_by_a_peer(failure) -> bool:
    """Whether a worker's failure is a peer's consequence: it ended with deepspeed.comm.PeerFailureError, which it
    writes into torchrun's error file (``peer_failure._mark_consequence``)."""
    message = failure.message
    text = message.get("message", "") if isinstance(message, dict) else str(message)
    return isinstance(text, str) and text.startswith("PeerFailureError")


def _failure_of(error) -> tuple:
    """(rank, exit code) of the worker that failed first in torchrun's ChildFailedError.

    torchrun orders failures by a timestamp in whole seconds, then as it found them (by local rank within one poll):
    a rank that died and the peer that raised PeerFailureError within the same instant (docs/faults.md) can come out
    in either order. A failure caused by a peer comes after every other, so the command reports the rank that
    failed on its own, with its own exit code (128 + N for signal N). Workers write torchrun's error file when an
    exception ends them (``peer_failure.record_uncaught_exceptions``).
    """
    order = {rank: index for index, rank in enumerate(error.failures)}
    rank, failure = min(error.failures.items(),
                        key=lambda item: (_caused_by_a_peer(item[1]), item[1].timestamp, order[item[0]]))
    code = failure.exitcode
    if code == -signal.SIGTERM and isinstance(failure.message, dict):
        # torchrun stopped it while it was exiting on an uncaught exception (its error file says which): the status
        # it was exiting with is Python's for that, 1
        return rank, 1
    return rank, (128 - code if code < 0 else code) or 1


def _child_pids() -> List[int]:
    """This process's children (Linux ``/proc``; empty where it cannot be read)."""
    pids: List[int] = []
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as handle:
                pids.extend(int(pid) for pid in handle.read().split())
    except OSError:
        pass
    return pids


class _StopRequested(Exception):
    """Raised in the main thread by SIGTERM before torchrun's own handler is installed."""


class _Stopper:
    """How a stop reaches this node's workers, and what the agent must undo when it leaves.

    ``request`` (from the controller link's thread) sends this process SIGTERM: torchrun's handler then stops
    the workers (SIGTERM, then SIGKILL), or, before torchrun took the signal over, ``on_sigterm`` ends the agent.
    Note: both handlers run in the main thread, which may be blocked in a native call (the rendezvous, the exit
    barrier: no worker runs then) and never run them; so after a grace period (short while no worker runs) the
    agent stops itself, with any children (``hard_stop``).
    """

    def __init__(self):
        self.requested = False
        self.link: Optional[ControllerLink] = None
        self.pid_file: Optional[str] = None

    def request(self) -> None:
        self.requested = True
        os.kill(os.getpid(), signal.SIGTERM)
        grace = HARD_STOP_AFTER_S if _child_pids() else HARD_STOP_IDLE_AFTER_S
        timer = threading.Timer(grace, self.hard_stop)
        timer.daemon = True
        timer.start()

    def on_sigterm(self, signum, _frame):
        self.requested = True
        raise _StopRequested(signum)

    def hard_stop(self) -> None:
        for pid in _child_pids():
            try:
                group = os.getpgid(pid)
                if group != os.getpgrp():
                    os.killpg(group, signal.SIGKILL)  # a worker in its own group takes its own children along
                else:
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        sys.stderr.write("[deepspeed launch] stopped without its workers' cooperation\n")
        sys.stderr.flush()
        self.leave(STOPPED_EXIT_CODE, None, True)
        os._exit(STOPPED_EXIT_CODE)

    def leave(self, code: int, rank: Optional[int], stopped: bool) -> None:
        """Report how the workers ended and remove the pid file."""
        if self.link is not None:
            self.link.report_exit(code, rank, stopped)
            self.link.close()
        if self.pid_file is not None and os.path.isfile(self.pid_file):
            os.remove(self.pid_file)


def _run_torchrun(torchrun_args: List[str]) -> tuple:
    """Run torchrun here; ``(exit code, failed rank or None, stopped on a signal)``."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as torchrun_parse_args
    from torch.distributed.run import run as torchrun_run
    try:
        torchrun_run(torchrun_parse_args(torchrun_args))
    except ChildFailedError as error:
        rank, code = _failure_of(error)
        return code, rank, False
    except (SignalException, _StopRequested, KeyboardInterrupt) as error:
        sigval = getattr(error, "sigval", None)
        return (128 + int(sigval) if sigval is not None else STOPPED_EXIT_CODE), None, True
    return 0, None, False


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.world_info == "None":
        raise ValueError("--world_info is required")
    world_info = decode_world_info(args.world_info)
    hosts = list(world_info)
    node_rank = args.node_rank if args.node_rank >= 0 else node_rank_from_environment(args.launcher, hosts, os.environ)
    if not 0 <= node_rank < len(hosts):
        raise ValueError(f"node rank {node_rank} is out of range for {len(hosts)} nodes")
    host = hosts[node_rank]
    slots = world_info[host]
    tag = f"[deepspeed launch] node {node_rank} ({host})"

    # Environment of the workers (torchrun passes os.environ on).
    if _cuda_device_count() > 0:
        os.environ[VISIBLE_DEVICES_ENV] = _visible_devices(slots, os.environ)
    if not args.elastic_training:  # elastic: the rendezvous numbers the nodes (torchrun's GROUP_RANK)
        os.environ["CROSS_RANK"] = str(node_rank)
        os.environ["CROSS_SIZE"] = str(len(hosts))
    os.environ["LOCAL_SIZE"] = str(len(slots))

    stopper = _Stopper()
    previous = signal.signal(signal.SIGTERM, stopper.on_sigterm)
    code, rank, stopped = 0, None, False
    try:
        if args.controller:
            stopper.link = ControllerLink(args.controller, args.job_token, node_rank, socket.gethostname(),
                                          stopper.request)
        if args.save_pid:
            stopper.pid_file = os.path.join(PID_FILE_BASEPATH, f"{args.save_pid}.deepspeed")
            with open(stopper.pid_file, "w") as handle:
                handle.write(str(os.getpid()))
        code, rank, stopped = _run_torchrun(torchrun_argv(args, len(hosts), node_rank, len(slots)))
        stopped = stopped or (stopper.requested and code != 0)
        if code != 0 and not stopped:
            print(f"{tag}: rank {rank} failed first with exit code {code}", file=sys.stderr, flush=True)
        elif stopped:
            print(f"{tag}: workers stopped", file=sys.stderr, flush=True)
    except _StopRequested:
        code, stopped = STOPPED_EXIT_CODE, True
    except ConnectionError as error:
        print(f"{tag}: {error}", file=sys.stderr, flush=True)
        code = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        stopper.leave(code, rank, stopped)
    return code


if __name__ == "__main__":
    sys.exit(main())
