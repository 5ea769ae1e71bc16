# SPDX-License-Identifier: Apache-2.0
"""The ``deepspeed`` command: start a training script on this node's devices through torchrun.

``deepspeed [launcher options] user_script [user_args...]`` works out how many processes this node runs, which
devices they see and how they meet the other nodes, then runs ``python -m torch.distributed.run`` with that plan.
torchrun sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` for every process;
unless ``--no_local_rank`` is given, the script also receives ``--local_rank=<n>`` like upstream.

The work is split so that everything but the final process start is a pure function of its inputs:
``parse_args`` -> ``plan_launch`` (a ``LaunchPlan``) -> ``build_torchrun_command`` and ``build_child_env`` ->
``run_command``.

Several nodes are supported the torchrun way: the command runs on every node with ``--node_rank`` and
``--master_addr`` (``--num_nodes`` or a hostfile give the node count). Starting the other nodes from one command
(ssh fan-out through pdsh, OpenMPI, MVAPICH, Slurm, ...) is not implemented and raises ``NotImplementedError``.
"""

import argparse
import os
import signal
import subprocess
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from deepspeed.launcher.constants import PDSH_LAUNCHER, TORCH_DISTRIBUTED_DEFAULT_PORT

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
DEEPSPEED_ENVIRONMENT_FILE_VAR = "DS_ENV_FILE"
DLTS_HOSTFILE = "/job/hostfile"
DEFAULT_MASTER_ADDR = "127.0.0.1"
# torchrun replaces this macro in every worker's arguments with that worker's local rank.
LOCAL_RANK_MACRO = "${local_rank}"
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_FAN_OUT_HINT = ("Starting processes on several nodes from one command (ssh fan-out through pdsh, OpenMPI, MVAPICH, "
                 "Slurm, ...) is not implemented. Run the same `deepspeed` command on every node and add "
                 "`--node_rank <this node's index> --master_addr <node 0's address>` (with `--num_nodes N` or the "
                 "hostfile giving the node count), or use torchrun directly.")


@dataclass(frozen=True)
class LaunchPlan:
    """What this node runs.

    ``local_slots`` are the device indices (relative to the devices this process can see) given to this node's
    processes, one per process; on a machine without CUDA they only count processes. ``device_count`` is the number
    of CUDA devices visible to the launcher (0 on CPU).
    """

    nproc_per_node: int
    num_nodes: int
    node_rank: int
    master_addr: str
    master_port: int
    local_slots: Tuple[int, ...]
    device_count: int


def parse_args(args: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the launcher's command line (``sys.argv[1:]`` when ``args`` is None).

    Everything after ``user_script`` is passed to the script untouched (``user_args``).
    """
    parser = argparse.ArgumentParser(
        prog="deepspeed",
        description="Launch a DeepSpeed training script on this node through torchrun (torch.distributed.run).")
    parser.add_argument("-H",
                        "--hostfile",
                        type=str,
                        default=DLTS_HOSTFILE,
                        help="File with one `hostname slots=N` line per node. Missing file: this node only.")
    parser.add_argument("-i",
                        "--include",
                        type=str,
                        default="",
                        help="Resources to use, `NAME[:SLOT[,SLOT...]][@NAME...]`, e.g. `localhost:0,2`.")
    parser.add_argument("-e",
                        "--exclude",
                        type=str,
                        default="",
                        help="Resources to leave out, same format as --include.")
    parser.add_argument("--num_nodes", type=int, default=-1, help="Number of nodes (default: all in the hostfile).")
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
                        help="Address of node 0 (default: 127.0.0.1 on one node, the first hostfile entry otherwise).")
    parser.add_argument("--node_rank", type=int, default=-1, help="Index of this node when running on several.")
    parser.add_argument("--launcher",
                        type=str,
                        default=PDSH_LAUNCHER,
                        help="Multi-node backend of upstream (pdsh, openmpi, ...). Accepted for compatibility; only "
                        "the per-node torchrun mode is implemented.")
    parser.add_argument("--launcher_args", type=str, default="", help="Accepted for compatibility; unused.")
    parser.add_argument("--module", action="store_true", help="Run user_script as a Python module, like `python -m`.")
    parser.add_argument("--no_python",
                        action="store_true",
                        help="Execute user_script directly instead of through the Python interpreter.")
    parser.add_argument("--no_local_rank",
                        action="store_true",
                        help="Do not pass --local_rank=<n> to the script (LOCAL_RANK is set in any case).")
    parser.add_argument("--no_ssh",
                        action="store_true",
                        help="Per-node launch without ssh (needs --node_rank); this is the only multi-node mode.")
    parser.add_argument("--no_ssh_check", action="store_true", help="Accepted for compatibility; no effect.")
    parser.add_argument("--force_multi",
                        action="store_true",
                        help="Upstream's forced ssh fan-out; not implemented unless --node_rank is given.")
    parser.add_argument("user_script", type=str, help="Training script (or module / executable) to run.")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="Arguments for user_script.")
    parsed = parser.parse_args(args)
    if parsed.module and parsed.no_python:
        parser.error("--module and --no_python cannot be used together")
    return parsed


def fetch_hostfile(hostfile_path: str) -> Optional["OrderedDict[str, int]"]:
    """Read a hostfile into ``{hostname: slots}`` in file order; None when the file does not exist.

    Lines are ``hostname slots=N``; blank lines and ``#`` comments are ignored. A malformed or duplicated line
    raises ValueError naming the line.
    """
    if not hostfile_path or not os.path.isfile(hostfile_path):
        return None
    pool: "OrderedDict[str, int]" = OrderedDict()
    with open(hostfile_path, encoding="utf-8") as handle:
        for number, raw_line in enumerate(handle, start=1):
            line = raw_line.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) != 2 or not fields[1].startswith("slots="):
                raise ValueError(f"{hostfile_path}:{number}: expected `hostname slots=N`, got {raw_line.strip()!r}")
            hostname, slots_text = fields[0], fields[1][len("slots="):]
            try:
                slots = int(slots_text)
            except ValueError:
                raise ValueError(f"{hostfile_path}:{number}: slot count {slots_text!r} is not an integer") from None
            if slots < 1:
                raise ValueError(f"{hostfile_path}:{number}: slot count must be positive, got {slots}")
            if hostname in pool:
                raise ValueError(f"{hostfile_path}:{number}: host {hostname!r} is listed twice")
            pool[hostname] = slots
    if not pool:
        raise ValueError(f"hostfile {hostfile_path} lists no hosts")
    return pool


def _parse_resource_spec(spec: str) -> "OrderedDict[str, Optional[List[int]]]":
    """Parse ``NAME[:SLOT[,SLOT...]][@NAME...]`` into ``{name: slots or None (= whole host)}``."""
    parsed: "OrderedDict[str, Optional[List[int]]]" = OrderedDict()
    for node_spec in spec.split("@"):
        node_spec = node_spec.strip()
        if not node_spec:
            raise ValueError(f"empty node in resource specification {spec!r}")
        if ":" in node_spec:
            hostname, slot_text = node_spec.split(":", 1)
            try:
                slots = [int(slot) for slot in slot_text.split(",")]
            except ValueError:
                raise ValueError(f"slots of {hostname!r} in {spec!r} must be integers") from None
            if hostname not in parsed:
                parsed[hostname] = slots
            elif parsed[hostname] is not None:
                parsed[hostname] += slots
        else:
            parsed[node_spec] = None
    return parsed


def parse_resource_filter(host_info: Mapping[str, List[int]],
                          include_str: str = "",
                          exclude_str: str = "") -> "OrderedDict[str, List[int]]":
    """Apply ``--include`` or ``--exclude`` to ``{host: [slot ids]}``.

    Returns the remaining hosts in ``host_info`` order with sorted, unique slots; hosts left with no slot are
    dropped. Include and exclude together, an unknown host or an unknown slot raise ValueError.
    """
    if include_str and exclude_str:
        raise ValueError("--include and --exclude are mutually exclusive")
    if not include_str and not exclude_str:
        return OrderedDict((host, sorted(set(slots))) for host, slots in host_info.items() if slots)
    spec = _parse_resource_spec(include_str or exclude_str)
    for hostname, slots in spec.items():
        if hostname not in host_info:
            raise ValueError(f"host {hostname!r} is not among the available hosts {list(host_info)}")
        for slot in slots or []:
            if slot not in host_info[hostname]:
                raise ValueError(f"slot {slot} of host {hostname!r} is not among its slots {host_info[hostname]}")
    filtered: "OrderedDict[str, List[int]]" = OrderedDict()
    for hostname, available in host_info.items():
        named = hostname in spec
        # A host named without slots stands for all of its slots.
        named_slots = set(available) if named and spec[hostname] is None else set(spec.get(hostname) or [])
        chosen = named_slots if include_str else set(available) - named_slots
        if chosen:
            filtered[hostname] = sorted(chosen)
    return filtered


def parse_inclusion_exclusion(resource_pool: Mapping[str, int], inclusion: str,
                              exclusion: str) -> "OrderedDict[str, List[int]]":
    """Apply ``--include``/``--exclude`` to ``{host: slot count}``; see ``parse_resource_filter``."""
    return parse_resource_filter(OrderedDict((host, list(range(slots))) for host, slots in resource_pool.items()),
                                 include_str=inclusion,
                                 exclude_str=exclusion)


def plan_launch(args: argparse.Namespace, device_count: int) -> LaunchPlan:
    """Decide what this node runs from the parsed arguments and the number of visible CUDA devices.

    One node (no hostfile, or one active host, and ``--num_nodes`` <= 1): ``--num_gpus`` processes (default: every
    visible GPU, or 1 process on a machine without CUDA). Several nodes: this node's share, which needs
    ``--node_rank``; without it NotImplementedError is raised, since only per-node launching is implemented.
    Contradictory or impossible requests raise ValueError.
    """
    if (args.include or args.exclude) and (args.num_nodes > 0 or args.num_gpus > 0):
        raise ValueError("--include/--exclude cannot be combined with --num_nodes/--num_gpus")
    if args.num_nodes == 0 or args.num_gpus == 0:
        raise ValueError("--num_nodes and --num_gpus must be positive when given")

    hostfile_pool = fetch_hostfile(args.hostfile)
    if hostfile_pool is None:
        if args.hostfile != DLTS_HOSTFILE:
            print(f"[deepspeed launcher] hostfile {args.hostfile} not found; using this node only",
                  file=sys.stderr,
                  flush=True)
        if device_count > 0:
            if args.num_gpus > device_count:
                raise ValueError(f"--num_gpus {args.num_gpus} asks for more GPUs than the {device_count} visible")
            local_count = device_count
        else:
            local_count = max(args.num_gpus, 1)
        pool = OrderedDict([("localhost", local_count)])
    else:
        pool = hostfile_pool

    active = parse_inclusion_exclusion(pool, args.include, args.exclude)
    if not active:
        raise ValueError("--include/--exclude left no resources to run on")
    if hostfile_pool is not None and args.num_nodes > 0:
        if args.num_nodes > len(active):
            raise ValueError(f"--num_nodes {args.num_nodes} asks for more nodes than the {len(active)} available")
        active = OrderedDict(list(active.items())[:args.num_nodes])
    if args.num_gpus > 0:
        active = OrderedDict((host, slots[:args.num_gpus]) for host, slots in active.items())

    # Without a hostfile every node runs the same command, so --num_nodes alone gives the node count.
    num_nodes = len(active) if hostfile_pool is not None else max(args.num_nodes, 1)
    if num_nodes == 1:
        node_rank = 0
        local_slots = next(iter(active.values()))
        master_addr = args.master_addr or DEFAULT_MASTER_ADDR
    else:
        if args.node_rank < 0:
            raise NotImplementedError(f"{num_nodes} nodes requested without --node_rank. " + _FAN_OUT_HINT)
        if args.node_rank >= num_nodes:
            raise ValueError(f"--node_rank {args.node_rank} is out of range for {num_nodes} nodes")
        node_rank = args.node_rank
        if hostfile_pool is not None:
            hosts = list(active)
            local_slots = active[hosts[node_rank]]
            master_addr = args.master_addr or hosts[0]
        else:
            local_slots = active["localhost"]
            if not args.master_addr:
                raise ValueError("--master_addr (node 0's address) is required with --num_nodes > 1")
            master_addr = args.master_addr
    if args.force_multi and num_nodes == 1:
        raise NotImplementedError("--force_multi asks for an ssh launch of a single node. " + _FAN_OUT_HINT)
    if device_count > 0 and max(local_slots) >= device_count:
        raise ValueError(f"slots {local_slots} of this node exceed the {device_count} visible GPUs")

    return LaunchPlan(nproc_per_node=len(local_slots),
                      num_nodes=num_nodes,
                      node_rank=node_rank,
                      master_addr=master_addr,
                      master_port=args.master_port,
                      local_slots=tuple(local_slots),
                      device_count=device_count)


def build_torchrun_command(args: argparse.Namespace, plan: LaunchPlan, python: Optional[str] = None) -> List[str]:
    """Return the ``python -m torch.distributed.run ...`` argv that carries out ``plan``.

    ``python`` defaults to the running interpreter. Unless ``--no_local_rank``, the script receives
    ``--local_rank=${local_rank}``, which torchrun replaces with each worker's local rank.
    """
    cmd = [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={plan.nproc_per_node}",
        f"--nnodes={plan.num_nodes}",
        f"--node_rank={plan.node_rank}",
        f"--master_addr={plan.master_addr}",
        f"--master_port={plan.master_port}",
    ]
    if args.module:
        cmd.append("--module")
    if args.no_python:
        cmd.append("--no_python")
    cmd.append(args.user_script)
    if not args.no_local_rank:
        cmd.append(f"--local_rank={LOCAL_RANK_MACRO}")
    cmd.extend(args.user_args)
    return cmd


def environment_file_paths(cwd: Optional[str] = None,
                           home: Optional[str] = None,
                           environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """Return the ``.deepspeed_env`` candidates in increasing priority: ``$DS_ENV_FILE``, home, cwd."""
    environ = os.environ if environ is None else environ
    paths = []
    if environ.get(DEEPSPEED_ENVIRONMENT_FILE_VAR):
        paths.append(environ[DEEPSPEED_ENVIRONMENT_FILE_VAR])
    paths.append(os.path.join(home or os.path.expanduser("~"), DEEPSPEED_ENVIRONMENT_NAME))
    paths.append(os.path.join(cwd or os.getcwd(), DEEPSPEED_ENVIRONMENT_NAME))
    return paths


def read_environment_files(paths: Sequence[str]) -> Dict[str, str]:
    """Read ``KEY=VALUE`` lines from the existing files among ``paths``; later files override earlier ones.

    Blank lines and ``#`` comments are skipped and a leading ``export`` is allowed. Each path is read once even if
    listed twice (home == cwd). A line without ``=`` raises ValueError naming the file and line.
    """
    values: Dict[str, str] = {}
    seen = set()
    for path in paths:
        real = os.path.realpath(path)
        if real in seen or not os.path.isfile(path):
            continue
        seen.add(real)
        with open(path, encoding="utf-8") as handle:
            for number, raw_line in enumerate(handle, start=1):
                line = raw_line.strip()
                if not line or line.startswith("#"):
                    continue
                if line.startswith("export "):
                    line = line[len("export "):].strip()
                key, sep, value = line.partition("=")
                if not sep or not key.strip():
                    raise ValueError(f"{path}:{number}: expected KEY=VALUE, got {raw_line.strip()!r}")
                values[key.strip()] = value.strip()
    return values


def build_child_env(plan: LaunchPlan,
                    base_env: Mapping[str, str],
                    file_env: Optional[Mapping[str, str]] = None,
                    cwd: Optional[str] = None) -> Dict[str, str]:
    """Return the environment for torchrun and its workers.

    ``base_env`` overridden by ``file_env`` (the ``.deepspeed_env`` values); the launch directory prepended to
    ``PYTHONPATH`` (as upstream); ``OMP_NUM_THREADS=1`` when more than one process runs here and it is unset; and,
    on a CUDA machine when only some devices are used, ``CUDA_VISIBLE_DEVICES`` narrowed to ``plan.local_slots``
    (indices into the devices visible so far).
    """
    env = dict(base_env)
    env.update(file_env or {})
    launch_dir = cwd or os.getcwd()
    env["PYTHONPATH"] = launch_dir + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if plan.nproc_per_node > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"
    if plan.device_count > 0 and list(plan.local_slots) != list(range(plan.device_count)):
        visible = env.get("CUDA_VISIBLE_DEVICES")
        visible_ids = visible.split(",") if visible else [str(i) for i in range(plan.device_count)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_ids[slot] for slot in plan.local_slots)
    return env


def run_command(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``cmd`` to completion and return its exit status.

    The child runs in its own session, so a terminal's Ctrl-C reaches it once, through this process: SIGINT,
    SIGTERM and SIGHUP received here are forwarded to it and the launcher keeps waiting for it to exit. The status
    is the child's own, except 128 + N when the child died of signal N, or exited non-zero after signal N was
    forwarded to it (torchrun itself exits 1 then), so callers see why the job stopped.
    """
    child = subprocess.Popen(list(cmd), env=dict(env), start_new_session=True)
    forwarded: List[int] = []

    def forward(signum, _frame):
        forwarded.append(signum)
        if child.poll() is None:
            child.send_signal(signum)

    previous = {}
    try:
        for signum in FORWARDED_SIGNALS:
            previous[signum] = signal.signal(signum, forward)
    except ValueError:
        # Not the main thread: signals cannot be caught here, the child still runs and is waited for.
        pass
    try:
        returncode = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if returncode < 0:
        return 128 - returncode
    if returncode != 0 and forwarded:
        return 128 + forwarded[0]
    return returncode


def _cuda_device_count() -> int:
    """Number of CUDA devices this process can see (0 without CUDA)."""
    import torch

    # device_count() asks NVML where it can and does not initialise CUDA in the launcher.
    return torch.cuda.device_count()


def main(args: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``deepspeed`` command; returns the exit status of the launched job."""
    parsed = parse_args(args)
    plan = plan_launch(parsed, device_count=_cuda_device_count())
    env = build_child_env(plan, os.environ, read_environment_files(environment_file_paths()))
    cmd = build_torchrun_command(parsed, plan)
    print(
        f"[deepspeed launcher] node {plan.node_rank}/{plan.num_nodes}, {plan.nproc_per_node} processes: "
        f"{' '.join(cmd)}",
        file=sys.stderr,
        flush=True)
    return run_command(cmd, env)


if __name__ == "__main__":
    sys.exit(main())
