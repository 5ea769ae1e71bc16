# SPDX-License-Identifier: Apache-2.0
"""``--launcher openmpi | mpich | impi | mvapich``: ``mpirun`` starts one node agent per host.

Each task's MPI rank is its node's index (the hosts are given to mpirun in plan order, one slot each), which the
agent reads from the launcher's variables (``launch.NODE_RANK_ENVS``); the agent then runs torchrun for its node,
so ``--include``/``--exclude``/``--num_gpus``/``--num_nodes`` and unequal slot counts work under every MPI. The
exported variables travel as mpirun arguments (``-x`` for Open MPI, ``-genv NAME VALUE`` for the Hydra-based MPICH
and Intel MPI, ``-env NAME=VALUE`` for MVAPICH as upstream), never through a shell. MPI itself is not used by the
job: torch.distributed's rendezvous connects the ranks.
"""

from typing import List, Mapping

from deepspeed.launcher.constants import (IMPI_LAUNCHER, MPICH_LAUNCHER, MVAPICH_LAUNCHER, MVAPICH_TMP_HOSTFILE,
                                          OPENMPI_LAUNCHER)
from deepspeed.launcher.runner_base import AgentOptions, MultiNodeRunner, Transport, _which
from deepspeed.launcher.plan import JobPlan


class _MPIRunner(MultiNodeRunner):
    """mpirun with one task per host: ``mpirun_args`` + ``--launcher_args`` + ``export_args`` + the agent."""

    def backend_exists(self) -> bool:
        return _which("mpirun")

    def mpirun_args(self, plan: JobPlan) -> List[str]:
        raise NotImplementedError

    def export_args(self) -> List[str]:
        raise NotImplementedError

    def transports(self, plan: JobPlan, options: AgentOptions, environment: Mapping[str, str]) -> List[Transport]:
        argv = self.mpirun_args(plan) + self.launcher_args() + self.export_args()
        argv += self.wrap_venv(self.agent_command(plan, options, "-1"))
        return [Transport("mpirun", argv, dict(environment))]


class OpenMPIRunner(_MPIRunner):
    launcher_name = OPENMPI_LAUNCHER

    def mpirun_args(self, plan: JobPlan) -> List[str]:
        return ["mpirun", "-n", str(plan.num_nodes), "--host", ",".join(plan.hosts), "--map-by", "ppr:1:node"]

    def export_args(self) -> List[str]:
        args = []
        for key, value in self.exports.items():
            args += ["-x", f"{key}={value}"]
        return args


class MPICHRunner(_MPIRunner):
    launcher_name = MPICH_LAUNCHER

    def mpirun_args(self, plan: JobPlan) -> List[str]:
        return ["mpirun", "-n", str(plan.num_nodes), "-ppn", "1", "-hosts", ",".join(plan.hosts)]

    def export_args(self) -> List[str]:
        args = []
        for key, value in self.exports.items():
            args += ["-genv", key, value]
        return args


class IMPIRunner(MPICHRunner):
    launcher_name = IMPI_LAUNCHER

    def export_args(self) -> List[str]:
        # Intel MPI would pin each task to a few cores; the agent's workers need the node's.
        return super().export_args() + ["-genv", "I_MPI_PIN", "0"]


class MVAPICHRunner(_MPIRunner):
    launcher_name = MVAPICH_LAUNCHER

    def __init__(self, args, world_info_base64: str = "", resource_pool=None):
        super().__init__(args, world_info_base64, resource_pool)
        # Upstream's MVAPICH settings: no CMA (missing on Ubuntu), backtraces, deep-learning support, no affinity.
        for key, value in (("MV2_SMP_USE_CMA", "0"), ("MV2_DEBUG_SHOW_BACKTRACE", "1"), ("MV2_SUPPORT_DL", "1"),
                           ("MV2_ENABLE_AFFINITY", "0"), ("MV2_INTER_ALLGATHER_TUNING", "5"), ("MV2_CUDA_USE_NAIVE",
                                                                                               "0")):
            self.add_export(key, value)

    def backend_exists(self) -> bool:
        return _which("mpirun") and _which("mpiname")

    def prepare(self, plan: JobPlan) -> None:
        with open(MVAPICH_TMP_HOSTFILE, "w") as handle:
            handle.writelines(f"{host}\n" for host in plan.hosts)

    def mpirun_args(self, plan: JobPlan) -> List[str]:
        return ["mpirun", "-np", str(plan.num_nodes), "-ppn", "1", "--hostfile", MVAPICH_TMP_HOSTFILE]

    def export_args(self) -> List[str]:
        args = []
        for key, value in self.exports.items():
            args += ["-env", f"{key}={value}"]
        return args
