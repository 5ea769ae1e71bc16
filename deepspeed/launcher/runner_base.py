# SPDX-License-Identifier: Apache-2.0
"""What every multi-node launcher shares: the base class, the process it starts (``Transport``), the agent's
options and the node agent's command line.

The launchers (``pdsh_runner``, ``ssh_runner``, ``mpi_runners``, ``slurm_runner``) import this module and nothing
imports them back from here, so the registry in ``multinode_runner`` can import every launcher at its top.
"""

import os
import shlex
import shutil
import sys
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

from deepspeed.launcher.plan import JobPlan, encode_world_info


@dataclass(frozen=True)
class Transport:
    """One process the launching node starts: ``argv`` with ``env``; ``node`` is the node it serves, or None when
    it serves every node (pdsh, mpirun, srun)."""

    label: str
    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    node: Optional[int] = None


@dataclass(frozen=True)
class AgentOptions:
    """How the node agents reach the launching node: its controller's address and the job's token."""

    controller: str = ""
    job_token: str = ""
    launch_dir: str = ""
    python: str = ""
    save_pid: int = 0


class MultiNodeRunner(ABC):
    """Base of the launchers. ``args`` are the ``deepspeed`` command's parsed arguments.

    Construction validates the arguments (``validate_args``): a flag the launcher cannot honour raises ValueError
    instead of being dropped. ``add_export`` collects the variables every node gets (``environment.py``).
    """

    #: Whether the launcher reaches the nodes over ssh (the pre-flight check applies).
    uses_ssh = False

    def __init__(self, args, world_info_base64: str = "", resource_pool=None):
        self.args = args
        self.world_info_base64 = world_info_base64
        #: Upstream's third argument ({host: slots}); ``get_cmd`` is given the hosts it starts.
        self.resource_pool = resource_pool
        self.exports: "OrderedDict[str, str]" = OrderedDict()
        self.validate_args()

    #: The ``--launcher`` value.
    launcher_name = ""

    @property
    def name(self) -> str:
        return self.launcher_name

    @abstractmethod
    def backend_exists(self) -> bool:
        """Whether the program this launcher runs is on PATH."""

    def transports(self, plan: JobPlan, options: AgentOptions, environment: Mapping[str, str]) -> List[Transport]:
        """The processes to start so that every node of ``plan`` runs its agent; ``environment`` is the launching
        process's, the base of each transport's. Every launcher here implements it; a subclass written against
        upstream's interface (``backend_exists`` and ``get_cmd`` only) constructs, and cannot be launched."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to start the node agents: implement "
                                  "transports(plan, options, environment)")

    def validate_args(self) -> None:
        if getattr(self.args, "ssh_port", None) is not None and not self.uses_ssh:
            raise ValueError(f"--ssh_port applies to the ssh and pdsh launchers; the {self.name} launcher starts "
                             "nodes its own way (give its options in --launcher_args)")

    def add_export(self, key: str, value: str) -> None:
        self.exports[key.strip()] = value

    def prepare(self, plan: JobPlan) -> None:
        """Write what the launcher needs on disk before it starts (nothing by default)."""

    def get_cmd(self, environment: Mapping[str, str], active_resources: Mapping[str, object]):
        """Upstream's entry point: what starts a node agent on every host of ``active_resources`` (``{host: slot
        ids}`` or ``{host: slot count}``), with ``environment`` as its base. As upstream's runners: ``pdsh`` gives
        ``(argv, kill_argv, env)``, the others the argv (a list of them where each node has its own process,
        ``ssh``). Nothing is started; ``prepare`` runs (MVAPICH's hostfile is written, as upstream's does)."""
        argvs = [t.argv for t in self.planned_transports(environment, active_resources)]
        return argvs[0] if len(argvs) == 1 else argvs

    def planned_transports(self, environment, active_resources) -> List[Transport]:
        """``transports`` for a plan of ``active_resources`` on this runner's arguments (``get_cmd``)."""
        hosts = OrderedDict((str(host), list(range(slots)) if isinstance(slots, int) else [int(s) for s in slots])
                            for host, slots in active_resources.items())
        plan = JobPlan(hosts=hosts,
                       master_addr=self.args.master_addr or next(iter(hosts)),
                       master_port=self.args.master_port,
                       fan_out=True,
                       node_rank=0)
        self.prepare(plan)
        return self.transports(plan, AgentOptions(launch_dir=os.path.abspath(".")), dict(environment))

    def launcher_args(self) -> List[str]:
        return shlex.split(self.args.launcher_args)

    def agent_command(self, plan: JobPlan, options: AgentOptions, node_rank: str) -> List[str]:
        """The node agent's argv; ``node_rank`` is a number, ``%n`` (pdsh) or ``-1`` (from the launcher)."""
        return node_agent_command(self.args, plan, options, node_rank, self.name, self.world_info_base64)

    def wrap_venv(self, command: List[str]) -> List[str]:
        """``command`` run after sourcing ``--venv_script`` (for launchers that start it without a shell)."""
        if self.args.venv_script is None:
            return command
        return ["bash", "-c", f'source {shlex.quote(self.args.venv_script)} && exec "$@"', "bash"] + command

    def remote_shell_command(self, plan: JobPlan, options: AgentOptions, node_rank: str) -> str:
        """One shell command line: the exports, ``cd`` to the launch directory, the venv script, the agent."""
        parts = [f"export {key}={shlex.quote(value)};" for key, value in self.exports.items()]
        parts.append(f"cd {shlex.quote(options.launch_dir or os.path.abspath('.'))};")
        if self.args.venv_script is not None:
            parts.append(f"source {shlex.quote(self.args.venv_script)};")
        parts.append(" ".join(shlex.quote(word) for word in self.agent_command(plan, options, node_rank)))
        return " ".join(parts)


def node_agent_command(args,
                       plan: JobPlan,
                       options: AgentOptions,
                       node_rank: str,
                       launcher: str = "",
                       world_info_base64: str = "") -> List[str]:
    """``python -u -m deepspeed.launcher.launch ...`` for the node ``node_rank`` of ``plan`` (see launch.py)."""
    cmd = [
        options.python or sys.executable, "-u", "-m", "deepspeed.launcher.launch",
        f"--world_info={world_info_base64 or encode_world_info(plan.hosts)}", f"--node_rank={node_rank}",
        f"--master_addr={plan.master_addr}", f"--master_port={plan.master_port}"
    ]
    if launcher:
        cmd.append(f"--launcher={launcher}")
    if options.controller:
        cmd += [f"--controller={options.controller}", f"--job_token={options.job_token}"]
    if args.module:
        cmd.append("--module")
    if args.no_python:
        cmd.append("--no_python")
    if args.no_local_rank:
        cmd.append("--no_local_rank")
    if options.save_pid:
        cmd.append(f"--save_pid={options.save_pid}")
    if args.enable_each_rank_log != "None":
        cmd.append(f"--enable_each_rank_log={args.enable_each_rank_log}")
    if args.bind_cores_to_rank:
        cmd.append("--bind_cores_to_rank")
    if args.bind_core_list is not None:
        cmd.append(f"--bind_core_list={args.bind_core_list}")
    if args.elastic_training:
        cmd += [
            "--elastic_training", f"--min_elastic_nodes={args.min_elastic_nodes}",
            f"--max_elastic_nodes={args.max_elastic_nodes}", f"--job_id={options.job_token or 'deepspeed'}"
        ]
    return cmd + [args.user_script] + list(args.user_args)


def _which(program: str) -> bool:
    return shutil.which(program) is not None
