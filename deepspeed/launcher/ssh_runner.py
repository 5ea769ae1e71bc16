# SPDX-License-Identifier: Apache-2.0
"""``--launcher ssh``: one ``ssh`` per host runs its node agent; needs nothing on the hosts but sshd.

Each host gets its node rank written into its command. ``--ssh_port`` and ``--launcher_args`` go to every ssh.
Because each node has its own ssh, a node that cannot be reached or whose agent does not start is named.
"""

from typing import List, Mapping

from deepspeed.launcher.runner_base import AgentOptions, MultiNodeRunner, Transport, _which
from deepspeed.launcher.plan import JobPlan

SSH_LAUNCHER = "ssh"


def ssh_base_command(ssh_port, launcher_args: List[str]) -> List[str]:
    """``ssh`` without a terminal and without password prompts (a prompt would hang a fan-out)."""
    return ["ssh", "-o", "BatchMode=yes"] + (["-p", str(ssh_port)] if ssh_port is not None else []) + launcher_args


class SSHRunner(MultiNodeRunner):
    launcher_name = SSH_LAUNCHER
    uses_ssh = True

    def backend_exists(self) -> bool:
        return _which("ssh")

    def transports(self, plan: JobPlan, options: AgentOptions, environment: Mapping[str, str]) -> List[Transport]:
        base = ssh_base_command(self.args.ssh_port, self.launcher_args())
        return [
            Transport(f"ssh {host}", base + [host, self.remote_shell_command(plan, options, str(index))],
                      dict(environment), index) for index, host in enumerate(plan.hosts)
        ]
