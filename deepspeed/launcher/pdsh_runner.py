# SPDX-License-Identifier: Apache-2.0
"""``--launcher pdsh`` (the default): one ``pdsh`` command runs the node agent on every host over ssh.

pdsh replaces ``%n`` in the command with the host's index in the ``-w`` list, which is the node rank; ``-S``
makes its exit status the largest of the nodes'. ``--ssh_port`` goes to ssh through ``PDSH_SSH_ARGS_APPEND``,
``--launcher_args`` to pdsh.
"""

import shlex
from typing import List, Mapping

from deepspeed.launcher.constants import PDSH_LAUNCHER, PDSH_MAX_FAN_OUT
from deepspeed.launcher.runner_base import AgentOptions, MultiNodeRunner, Transport, _which
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

    def get_cmd(self, environment, active_resources):
        """``(argv, kill_argv, env)`` as upstream's: ``kill_argv`` ends this job's agents on every host (they are
        found by the job's world info, which no other job shares)."""
        transport, = self.planned_transports(environment, active_resources)
        world_info = next(word for word in shlex.split(transport.argv[-1]) if word.startswith("--world_info="))
        kill = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(map(str, active_resources))]
        kill.append(f"pkill -f -- {shlex.quote(world_info)}")
        return transport.argv, kill, transport.env
