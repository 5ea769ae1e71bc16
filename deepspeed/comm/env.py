# SPDX-License-Identifier: Apache-2.0
"""Discovery of this process's place in the job, for ``init_distributed``.

The job description comes, in order of precedence, from explicit arguments,
from the variables torchrun (and the ``deepspeed`` launcher) export
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
from Open MPI's variables (``OMPI_COMM_WORLD_*``) when MPI discovery is on,
and finally from the defaults of a single-process job on this host.
"""

import dataclasses
import os
import socket

LOCALHOST = "127.0.0.1"


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


def _int_env(*names):
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return None


def discover(rank=-1, world_size=-1, auto_mpi_discovery=True, distributed_port=29500):
    """Resolve the job description.

    ``rank``/``world_size`` >= 0 override the environment. A job of one process
    with no rendezvous address gets ``127.0.0.1`` and a free port; a job of
    several processes without ``MASTER_ADDR`` is an error (there is no way to
    agree on one without a launcher). Without a local rank in the environment,
    the local rank is the global rank (one node).
    """
    env_rank = _int_env("RANK")
    env_world = _int_env("WORLD_SIZE")
    env_local = _int_env("LOCAL_RANK")
    if env_rank is None and auto_mpi_discovery:
        env_rank = _int_env("OMPI_COMM_WORLD_RANK", "PMI_RANK")
        env_world = _int_env("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
        env_local = _int_env("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")

    rank = rank if rank is not None and rank >= 0 else (env_rank if env_rank is not None else 0)
    world_size = world_size if world_size is not None and world_size > 0 else (env_world or 1)
    local_rank = env_local if env_local is not None else rank
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")

    master_addr = os.environ.get("MASTER_ADDR")
    master_port = _int_env("MASTER_PORT")
    if master_addr is None:
        if world_size > 1:
            raise RuntimeError(f"world size is {world_size} but MASTER_ADDR is not set; launch with torchrun or the "
                               "deepspeed launcher, or set MASTER_ADDR/MASTER_PORT")
        master_addr = LOCALHOST
        master_port = master_port or free_port()
    if master_port is None:
        master_port = distributed_port
    return LaunchEnv(rank, world_size, local_rank, master_addr, master_port)
