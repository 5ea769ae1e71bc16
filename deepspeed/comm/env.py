# SPDX-License-Identifier: Apache-2.0
"""Discovery of this process's place in the job, for ``init_distributed``.

The job description comes, in order of precedence, from explicit arguments, from the variables torchrun (and
the ``deepspeed`` launcher) export (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
and, when launcher discovery is on (``auto_mpi_discovery``), from the variables of the program that started the
process (``LAUNCHER_ENVS``: Open MPI, MVAPICH, MPICH / Intel MPI (PMI), Slurm), so that ``mpirun python train.py``
and ``srun python train.py`` work without the ``deepspeed`` launcher; finally from the defaults of a
single-process job on this host.

The rendezvous address is ``MASTER_ADDR`` when set; under Slurm, the first host of the step's node list (the
node of task 0); when every rank runs on this host, 127.0.0.1. Otherwise it cannot be known from the environment
and discovery raises, saying what to set. The port is ``MASTER_PORT``, else ``distributed_port``.
"""

import dataclasses
import os
import re
import socket
from typing import List, Mapping, NamedTuple, Optional, Tuple

LOCALHOST = "127.0.0.1"


class LauncherEnv(NamedTuple):
    """Where a launcher keeps rank, world size, local rank and (optionally) local size."""
    name: str
    rank: Tuple[str, ...]
    size: Tuple[str, ...]
    local_rank: Tuple[str, ...]
    local_size: Tuple[str, ...]


# Most specific first: an mpirun inside a Slurm allocation also sees the allocation's SLURM_* variables.
LAUNCHER_ENVS = (
    LauncherEnv("Open MPI", ("OMPI_COMM_WORLD_RANK", ), ("OMPI_COMM_WORLD_SIZE", ), ("OMPI_COMM_WORLD_LOCAL_RANK", ),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", )),
    LauncherEnv("MVAPICH", ("MV2_COMM_WORLD_RANK", ), ("MV2_COMM_WORLD_SIZE", ), ("MV2_COMM_WORLD_LOCAL_RANK", ),
                ("MV2_COMM_WORLD_LOCAL_SIZE", )),
    LauncherEnv("MPICH/Intel MPI", ("PMI_RANK", "PMIX_RANK"), ("PMI_SIZE", ), ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID"),
                ("MPI_LOCALNRANKS", "PALS_LOCAL_SIZE")),
    LauncherEnv("Slurm", ("SLURM_PROCID", ), ("SLURM_NTASKS", ), ("SLURM_LOCALID", ), ()),
)
SLURM_NODELIST_ENVS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits: global rank, world size, rank on this node, rendezvous address."""
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    def export(self, with_rendezvous=True):
        """Write the description into ``os.environ`` so that ``env://`` and later readers agree with it."""
        os.environ["RANK"] = str(self.rank)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        os.environ["LOCAL_RANK"] = str(self.local_rank)
        if with_rendezvous:
            os.environ["MASTER_ADDR"] = self.master_addr
            os.environ["MASTER_PORT"] = str(self.master_port)


def free_port(host=LOCALHOST):
    """A TCP port on ``host`` that nothing listens on at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _int_env(*names, environ=None):
    environ = os.environ if environ is None else environ
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            return int(value)
    return None


def _split_outside_brackets(text: str) -> List[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise ValueError(f"unbalanced brackets in host list {text!r}")
    parts.append(current)
    return [part.strip() for part in parts if part.strip()]


def _expand_ranges(body: str) -> List[str]:
    """``01-03,7`` -> ``["01", "02", "03", "7"]``; a range keeps its zero padding."""
    values = []
    for item in body.split(","):
        low, sep, high = item.strip().partition("-")
        if not sep:
            values.append(low)
            continue
        width = len(low) if low.startswith("0") else 0
        if int(high) < int(low):
            raise ValueError(f"range {item!r} runs backwards")
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def expand_hostlist(text: str) -> List[str]:
    """Slurm's compressed host list, in order: ``node[01-03,7],gpu5`` -> node01 node02 node03 node7 gpu5.

    Several bracket groups in one name multiply out (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2).
    """
    hosts: List[str] = []
    for entry in _split_outside_brackets(text):
        match = re.search(r"\[([^\]]*)\]", entry)
        if match is None:
            hosts.append(entry)
            continue
        prefix, suffix = entry[:match.start()], entry[match.end():]
        for value in _expand_ranges(match.group(1)):
            hosts.extend(expand_hostlist(prefix + value + suffix))
    return hosts


def launcher_ranks(environ: Optional[Mapping[str, str]] = None):
    """``(launcher name, rank, world size, local rank or None, local size or None)`` from the first launcher in
    ``LAUNCHER_ENVS`` whose rank and size are both set, else None."""
    environ = os.environ if environ is None else environ
    for launcher in LAUNCHER_ENVS:
        rank = _int_env(*launcher.rank, environ=environ)
        size = _int_env(*launcher.size, environ=environ)
        if rank is not None and size is not None:
            return (launcher.name, rank, size, _int_env(*launcher.local_rank, environ=environ),
                    _int_env(*launcher.local_size, environ=environ))
    return None


def slurm_master_addr(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The first host of the Slurm step's node list (where task 0 runs), or None outside Slurm."""
    environ = os.environ if environ is None else environ
    for name in SLURM_NODELIST_ENVS:
        if environ.get(name):
            hosts = expand_hostlist(environ[name])
            if hosts:
                return hosts[0]
    return None


def discover(rank=-1, world_size=-1, auto_mpi_discovery=True, distributed_port=29500, environ=None):
    """Resolve the job description (see the module docstring).

    ``rank``/``world_size`` >= 0 override the environment. A job of one process with no rendezvous address gets
    ``127.0.0.1`` and a free port; a job of several processes whose rendezvous address cannot be found raises
    RuntimeError. Without a local rank in the environment, the local rank is the global rank (one node).
    """
    environ = os.environ if environ is None else environ
    env_rank = _int_env("RANK", environ=environ)
    env_world = _int_env("WORLD_SIZE", environ=environ)
    env_local = _int_env("LOCAL_RANK", environ=environ)
    source, local_size = "torchrun", None
    if env_rank is None and auto_mpi_discovery:
        found = launcher_ranks(environ)
        if found is not None:
            source, env_rank, env_world, env_local, local_size = found

    rank = rank if rank is not None and rank >= 0 else (env_rank if env_rank is not None else 0)
    world_size = world_size if world_size is not None and world_size > 0 else (env_world or 1)
    local_rank = env_local if env_local is not None else rank
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")

    master_addr = environ.get("MASTER_ADDR") or None
    master_port = _int_env("MASTER_PORT", environ=environ)
    if master_addr is None and world_size > 1 and source == "Slurm":
        master_addr = slurm_master_addr(environ)
    if master_addr is None and world_size > 1 and local_size == world_size:
        master_addr = LOCALHOST  # every rank on this host
    if master_addr is None:
        if world_size > 1:
            raise RuntimeError(f"world size is {world_size} (from {source}) but the rendezvous address is unknown: "
                               "set MASTER_ADDR (and MASTER_PORT) to the address of rank 0's host, e.g. "
                               "`mpirun -x MASTER_ADDR=<host> ...`, or launch with torchrun or the deepspeed "
                               "launcher")
        master_addr = LOCALHOST
        master_port = master_port or free_port()
    if master_port is None:
        master_port = distributed_port
    return LaunchEnv(rank, world_size, local_rank, master_addr, master_port)
