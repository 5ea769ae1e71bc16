# SPDX-License-Identifier: Apache-2.0
"""init_distributed's discovery of rank, world size, local rank and rendezvous from launchers' variables."""

import pytest

from deepspeed.comm import env

# yapf: disable
DISCOVERY_CASES = [
    # torchrun / the deepspeed launcher
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "7"}, (3, 4, 1, "h", 7)),
    # torchrun's variables win over the launcher's that started the node agent
    ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "OMPI_COMM_WORLD_RANK": "1",
      "OMPI_COMM_WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, (2, 4, 0, "h", 29500)),
    # Open MPI, every rank on this host
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (1, 2, 1, "127.0.0.1", 29500)),
    # Open MPI inside a Slurm allocation: mpirun's variables
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "MASTER_ADDR": "m", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODELIST": "n[1-2]"},
     (3, 4, 1, "m", 29500)),
    # MPICH / Intel MPI (PMI), MVAPICH
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MASTER_ADDR": "m", "MASTER_PORT": "9"},
     (2, 4, 0, "m", 9)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
     (1, 2, 1, "127.0.0.1", 29500)),
    ({"MV2_COMM_WORLD_RANK": "5", "MV2_COMM_WORLD_SIZE": "8", "MV2_COMM_WORLD_LOCAL_RANK": "1", "MASTER_ADDR": "m"},
     (5, 8, 1, "m", 29500)),
    # Slurm: the first host of the step's node list is the rendezvous
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODELIST": "gpu[07-08,10]"},
     (3, 4, 1, "gpu07", 29500)),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "a,b",
      "SLURM_STEP_NODELIST": "b,c", "MASTER_PORT": "6000"}, (0, 2, 0, "b", 6000)),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NODELIST": "n1", "MASTER_ADDR": "x"},
     (1, 2, 1, "x", 29500)),
]
# yapf: enable


@pytest.mark.parametrize("environ, expected", DISCOVERY_CASES)
def test_discover(environ, expected):
    found = env.discover(environ=environ)
    assert (found.rank, found.world_size, found.local_rank, found.master_addr, found.master_port) == expected


def test_discovery_off_and_overrides():
    environ = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n1"}
    alone = env.discover(auto_mpi_discovery=False, environ=environ)
    assert (alone.rank, alone.world_size, alone.master_addr) == (0, 1, "127.0.0.1")
    forced = env.discover(rank=0, world_size=1, environ=environ)
    assert (forced.rank, forced.world_size) == (0, 1)


def test_unknown_rendezvous_is_an_error():
    environ = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        env.discover(environ=environ)
    with pytest.raises(ValueError, match="outside"):
        env.discover(environ={"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "SLURM_NODELIST": "n1"})


# yapf: disable
HOSTLIST_CASES = [
    ("node1", ["node1"]),
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("x[1-2]-ib", ["x1-ib", "x2-ib"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
]
# yapf: enable


@pytest.mark.parametrize("text, expected", HOSTLIST_CASES)
def test_expand_hostlist(text, expected):
    assert env.expand_hostlist(text) == expected


@pytest.mark.parametrize("text", ["n[1-2", "n[3-1]", "n[a-b]"])
def test_bad_hostlist(text):
    with pytest.raises(ValueError):
        env.expand_hostlist(text)
