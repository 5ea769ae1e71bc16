# SPDX-License-Identifier: Apache-2.0
"""``--launcher slurm``: ``srun`` starts one node agent on each host of the plan.

``srun -n <nodes> --ntasks-per-node=1 --nodes=<nodes> --nodelist=<hosts> --kill-on-bad-exit=1 --export=ALL``: the
hosts must be Slurm node names; each agent finds its node by name (``SLURMD_NODENAME``), since srun orders the
nodes its own way, and takes that host's slots, so the plan's filters and unequal slot counts hold. The exported
variables are set in srun's own environment, which ``--export=ALL`` hands to every task intact (a value with a
comma cannot be written into ``--export=`` itself).
"""

from typing import List, Mapping

from deepspeed.launcher.constants import SLURM_LAUNCHER
from deepspeed.launcher.runner_base import AgentOptions, MultiNodeRunner, Transport, _which
from deepspeed.launcher.plan import JobPlan


class SlurmRunner(MultiNodeRunner):
    launcher_name = SLURM_LAUNCHER

    def backend_exists(self) -> bool:
        return _which("srun")

    def transports(self, plan: JobPlan, options: AgentOptions, environment: Mapping[str, str]) -> List[Transport]:
        argv = [
            "srun", "-n",
            str(plan.num_nodes), "--ntasks-per-node=1", f"--nodes={plan.num_nodes}",
            f"--nodelist={','.join(plan.hosts)}", "--kill-on-bad-exit=1"
        ] + self.launcher_args() + ["--export=ALL"]
        argv += self.wrap_venv(self.agent_command(plan, options, "-1"))
        env = dict(environment)
        env.update(self.exports)
        return [Transport("srun", argv, env)]
