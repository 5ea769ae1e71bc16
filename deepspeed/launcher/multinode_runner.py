# SPDX-License-Identifier: Apache-2.0
"""The multi-node launchers, under upstream's class names, and what they share.

A launcher turns the job plan into the command(s) that start one node agent (``deepspeed.launcher.launch``) on
every node: ``pdsh`` (default) and ``ssh`` run it through a remote shell, ``openmpi``, ``mpich``, ``impi`` and
``mvapich`` through ``mpirun`` with one task per node, ``slurm`` through ``srun`` with one task per node. Each
agent then runs torchrun for its node, so the per-node process model is the same under every launcher. The
launchers live one per module (``pdsh_runner``, ``ssh_runner``, ``mpi_runners``, ``slurm_runner``) over the base
class in ``runner_base``; this module re-exports them under upstream's module path and holds the registry.

Building commands is pure (``transports``): nothing is started, no file is written (``prepare`` writes what a
launcher needs on disk, such as MVAPICH's hostfile).
"""

from collections import OrderedDict

from deepspeed.launcher.runner_base import AgentOptions, MultiNodeRunner, Transport, node_agent_command  # noqa: F401
from deepspeed.launcher.pdsh_runner import PDSHRunner
from deepspeed.launcher.ssh_runner import SSHRunner
from deepspeed.launcher.mpi_runners import IMPIRunner, MPICHRunner, MVAPICHRunner, OpenMPIRunner
from deepspeed.launcher.slurm_runner import SlurmRunner

LAUNCHER_CLASSES = OrderedDict(
    (cls.launcher_name, cls)
    for cls in (PDSHRunner, SSHRunner, OpenMPIRunner, MPICHRunner, IMPIRunner, MVAPICHRunner, SlurmRunner))

__all__ = [
    "MultiNodeRunner", "Transport", "AgentOptions", "PDSHRunner", "SSHRunner", "OpenMPIRunner", "MPICHRunner",
    "IMPIRunner", "MVAPICHRunner", "SlurmRunner", "LAUNCHER_CLASSES"
]
