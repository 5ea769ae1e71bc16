# SPDX-License-Identifier: Apache-2.0
"""``--launcher pdsh`` (the default): one ``pdsh`` command runs the node agent on every host over ssh.

pdsh replaces ``%n`` in the command with the host's index in the ``-w`` list, which is the node rank; ``-S``
makes its exit status the largest of the nodes'. ``--ssh_port`` goes to ssh through ``PDSH_SSH_ARGS_APPEND``,
``--launcher_args`` to pdsh.
"""

from typing import List, Mapping

from deepspeed.launcher.constants import PDSH_LAUNCHER, PDSH_MAX_FAN_OUT
from deepspeed.launcher.multinode_runner import AgentOptions, MultiNodeRunner, Transport, _which
from deepspeed.launcher.plan import JobPlan


class PDSHRunner(MultiNodeRunner):
    launcher_name = PDSH_LAUNCHER
    uses_ssh = True

    def backend_exists(self) -> bool:
        return _which("pdsh")

    def transports(self, plan: JobPlan, options: AgentOptions, environment: Mapping[str, str]) -> List[Transport]:
        env = dict(environment)
        env["PDSH_RCMD_TYPE"] = "ssh"
        if self.args.ssh_port is not None:
            env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {self.args.ssh_port}".strip()
        argv = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(plan.hosts)] + self.launcher_args()
        argv.append(self.remote_shell_command(plan, options, "%n"))
        return [Transport("pdsh", argv, env)]
