# SPDX-License-Identifier: Apache-2.0
"""The launch plan: which hosts run how many processes on which devices, as pure functions of the inputs.

Everything the ``deepspeed`` command decides before starting a process lives here, so it can be tested without
processes: the hostfile (``parse_hostfile``), ``--include``/``--exclude`` (``parse_resource_filter``),
``--num_nodes``/``--num_gpus`` (``apply_num_nodes_and_gpus``), the world info handed to every node
(``encode_world_info``), and the whole ``JobPlan`` (``plan_job``).

Slot ids are device ids on their host. On a host that has no CUDA device they only count processes.
"""

import base64
import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, List, Mapping, Optional, Sequence

DLTS_HOSTFILE = "/job/hostfile"
DEFAULT_MASTER_ADDR = "127.0.0.1"
LOCALHOST = "localhost"
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"

# `hostname slots=N`, anything after a `#` being a comment.
_HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)$")


@dataclass(frozen=True)
class JobPlan:
    """What the job runs where.

    ``hosts`` maps each active host, in hostfile order, to its slot ids; node ``i`` is the ``i``-th host and its
    processes take the next global ranks. ``fan_out`` is true when this command starts every node (ssh, pdsh, MPI,
    Slurm); false when it runs this node only (one node, or ``--no_ssh`` with ``node_rank``). ``devices_from_env``
    is true when the slot ids were read from ``CUDA_VISIBLE_DEVICES`` (which the child must then not inherit).
    """

    hosts: "OrderedDict[str, List[int]]"
    master_addr: str
    master_port: int
    fan_out: bool
    node_rank: int
    devices_from_env: bool = False

    @property
    def num_nodes(self) -> int:
        return len(self.hosts)

    @property
    def world_size(self) -> int:
        return sum(len(slots) for slots in self.hosts.values())


def parse_hostfile(lines: Iterable[str], source: str = "hostfile") -> "OrderedDict[str, int]":
    """Parse hostfile lines into ``{hostname: slots}`` in file order.

    Lines are ``hostname slots=N``; blank lines and ``#`` comments (whole-line or trailing) are skipped. A malformed
    line, a duplicated host, a zero slot count or a file without hosts raise ValueError naming the line.
    """
    pool: "OrderedDict[str, int]" = OrderedDict()
    for number, raw_line in enumerate(lines, start=1):
        line = raw_line.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOSTFILE_LINE.match(line)
        if match is None:
            raise ValueError(f"{source}:{number}: expected `hostname slots=N`, got {raw_line.strip()!r}")
        host, slots = match.group(1), int(match.group(2))
        if slots < 1:
            raise ValueError(f"{source}:{number}: slot count must be positive, got {slots}")
        if host in pool:
            raise ValueError(f"{source}:{number}: host {host!r} is listed twice")
        pool[host] = slots
    if not pool:
        raise ValueError(f"{source} lists no hosts")
    return pool


def fetch_hostfile(hostfile_path: str) -> Optional["OrderedDict[str, int]"]:
    """Read a hostfile into ``{hostname: slots}``; None when the file does not exist."""
    if not hostfile_path or not os.path.isfile(hostfile_path):
        return None
    with open(hostfile_path, encoding="utf-8") as handle:
        return parse_hostfile(handle.readlines(), source=hostfile_path)


def _parse_resource_spec(spec: str) -> "OrderedDict[str, Optional[List[int]]]":
    """Parse ``NAME[:SLOT[,SLOT...]][@NAME...]`` into ``{name: slots, or None for the whole host}``."""
    parsed: "OrderedDict[str, Optional[List[int]]]" = OrderedDict()
    for node_spec in spec.split("@"):
        node_spec = node_spec.strip()
        if not node_spec:
            raise ValueError(f"empty node in resource specification {spec!r}")
        if ":" in node_spec:
            hostname, slot_text = node_spec.split(":", 1)
            try:
                slots = [int(slot) for slot in slot_text.split(",")]
            except ValueError:
                raise ValueError(f"slots of {hostname!r} in {spec!r} must be integers") from None
            if hostname not in parsed:
                parsed[hostname] = slots
            elif parsed[hostname] is not None:
                parsed[hostname] += slots
        else:
            parsed[node_spec] = None
    return parsed


def parse_resource_filter(host_info: Mapping[str, List[int]],
                          include_str: str = "",
                          exclude_str: str = "") -> "OrderedDict[str, List[int]]":
    """Apply ``--include`` or ``--exclude`` to ``{host: [slot ids]}``.

    Returns the remaining hosts in ``host_info`` order with sorted, unique slots; hosts left with no slot are
    dropped. Include and exclude together, an unknown host or an unknown slot raise ValueError.
    """
    if include_str and exclude_str:
        raise ValueError("--include and --exclude are mutually exclusive")
    if not include_str and not exclude_str:
        return OrderedDict((host, sorted(set(slots))) for host, slots in host_info.items() if slots)
    spec = _parse_resource_spec(include_str or exclude_str)
    for hostname, slots in spec.items():
        if hostname not in host_info:
            raise ValueError(f"host {hostname!r} is not among the available hosts {list(host_info)}")
        for slot in slots or []:
            if slot not in host_info[hostname]:
                raise ValueError(f"slot {slot} of host {hostname!r} is not among its slots {host_info[hostname]}")
    filtered: "OrderedDict[str, List[int]]" = OrderedDict()
    for hostname, available in host_info.items():
        named = hostname in spec
        # A host named without slots stands for all of its slots.
        named_slots = set(available) if named and spec[hostname] is None else set(spec.get(hostname) or [])
        chosen = named_slots if include_str else set(available) - named_slots
        if chosen:
            filtered[hostname] = sorted(chosen)
    return filtered


def parse_inclusion_exclusion(resource_pool: Mapping[str, int], inclusion: str,
                              exclusion: str) -> "OrderedDict[str, List[int]]":
    """Apply ``--include``/``--exclude`` to ``{host: slot count}``; see ``parse_resource_filter``."""
    return parse_resource_filter(OrderedDict((host, list(range(slots))) for host, slots in resource_pool.items()),
                                 include_str=inclusion,
                                 exclude_str=exclusion)


def apply_num_nodes_and_gpus(active: Mapping[str, List[int]], num_nodes: int,
                             num_gpus: int) -> "OrderedDict[str, List[int]]":
    """Keep the first ``num_nodes`` hosts and the first ``num_gpus`` slots of each (a value <= 0 keeps all).

    Asking for more nodes, or more slots on a host, than there are raises ValueError.
    """
    hosts = list(active.items())
    if num_nodes > 0:
        if num_nodes > len(hosts):
            raise ValueError(f"--num_nodes {num_nodes} asks for more nodes than the {len(hosts)} available")
        hosts = hosts[:num_nodes]
    if num_gpus > 0:
        for host, slots in hosts:
            if num_gpus > len(slots):
                raise ValueError(f"--num_gpus {num_gpus} asks for more slots than the {len(slots)} of {host!r}")
        hosts = [(host, slots[:num_gpus]) for host, slots in hosts]
    return OrderedDict(hosts)


def encode_world_info(world_info: Mapping[str, Sequence[int]]) -> str:
    """``{host: [slot ids]}`` as URL-safe base64 of its JSON text (upstream's ``--world_info`` encoding)."""
    return base64.urlsafe_b64encode(json.dumps(dict(world_info)).encode("utf-8")).decode("utf-8")


def decode_world_info(encoded: str) -> "OrderedDict[str, List[int]]":
    """Inverse of ``encode_world_info``, keeping the host order."""
    decoded = json.loads(base64.urlsafe_b64decode(encoded.encode("utf-8")), object_pairs_hook=OrderedDict)
    if not isinstance(decoded, dict) or not decoded:
        raise ValueError("world info must name at least one host")
    return OrderedDict((str(host), [int(slot) for slot in slots]) for host, slots in decoded.items())


def _local_pool(args, device_count: int, environ: Mapping[str, str]):
    """The one-host pool without a hostfile: ``({"localhost": slots}, devices_from_env)``."""
    visible = environ.get(VISIBLE_DEVICES_ENV, "")
    filtered = bool(args.include or args.exclude or args.num_gpus > 0 or args.num_nodes > 1)
    if device_count > 0 and visible.strip() and not filtered:
        # As upstream: the visible devices become the slots, so `CUDA_VISIBLE_DEVICES=2,3 deepspeed x.py` runs on
        # devices 2 and 3 and each worker sees exactly its own.
        return OrderedDict([(LOCALHOST, [int(d) for d in visible.split(",") if d.strip()])]), True
    if device_count > 0:
        if args.num_gpus > device_count:
            raise ValueError(f"--num_gpus {args.num_gpus} asks for more GPUs than the {device_count} visible")
        return OrderedDict([(LOCALHOST, list(range(device_count)))]), False
    return OrderedDict([(LOCALHOST, list(range(max(args.num_gpus, 1))))]), False


def plan_job(args, device_count: int, environ: Optional[Mapping[str, str]] = None) -> JobPlan:
    """Decide what the job runs from the parsed arguments and this host's number of CUDA devices.

    Without a hostfile: one node (``localhost``), ``--num_gpus`` processes (default: every visible GPU, or one on a
    machine without CUDA), or with ``--num_nodes N --node_rank R --master_addr A`` this node's share of N identical
    nodes. With a hostfile: its hosts, filtered by ``--include``/``--exclude`` and trimmed by
    ``--num_nodes``/``--num_gpus``; several hosts (or ``--force_multi``) start every node from here, unless
    ``--no_ssh``, which runs node ``--node_rank`` only. Contradictory or impossible requests raise ValueError.
    """
    environ = os.environ if environ is None else environ
    if (args.include or args.exclude) and (args.num_nodes > 0 or args.num_gpus > 0):
        raise ValueError("--include/--exclude cannot be combined with --num_nodes/--num_gpus")
    if args.num_nodes == 0 or args.num_gpus == 0:
        raise ValueError("--num_nodes and --num_gpus must be positive when given")

    hostfile_pool = fetch_hostfile(args.hostfile)
    devices_from_env = False
    if hostfile_pool is None:
        pool, devices_from_env = _local_pool(args, device_count, environ)
        active = parse_resource_filter(pool, args.include, args.exclude)
        active = apply_num_nodes_and_gpus(active, -1, args.num_gpus)
    else:
        active = parse_inclusion_exclusion(hostfile_pool, args.include, args.exclude)
        active = apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    if not active:
        raise ValueError("--include/--exclude left no resources to run on")

    if hostfile_pool is None and args.num_nodes > 1:
        # Several identical nodes without a hostfile: the torchrun way, this command on every node.
        if args.node_rank < 0:
            raise ValueError(f"--num_nodes {args.num_nodes} without a hostfile runs one node per command: give "
                             "--node_rank and --master_addr on each node, or a hostfile to start them all from here")
        if not args.master_addr:
            raise ValueError("--master_addr (node 0's address) is required with --num_nodes > 1")
        slots = active[LOCALHOST]
        active = OrderedDict((f"node{index}", list(slots)) for index in range(args.num_nodes))
    if args.no_ssh and args.node_rank < 0 and len(active) > 1:
        raise ValueError("--no_ssh runs this node only and needs --node_rank")
    if args.node_rank >= len(active):
        raise ValueError(f"--node_rank {args.node_rank} is out of range for {len(active)} nodes")

    fan_out = (len(active) > 1 or args.force_multi) and not args.no_ssh and args.node_rank < 0
    if hostfile_pool is None and args.force_multi:
        raise ValueError("--force_multi needs a hostfile naming the node to start")
    if len(active) > 1 and not fan_out and args.node_rank < 0:
        raise ValueError("several nodes need --node_rank when this command runs only one of them")
    node_rank = 0 if fan_out or len(active) == 1 else args.node_rank
    if hostfile_pool is None and args.num_nodes <= 1:
        master_addr = args.master_addr or DEFAULT_MASTER_ADDR
    else:
        master_addr = args.master_addr or next(iter(active))
    if device_count > 0 and not fan_out and hostfile_pool is not None:
        local_slots = list(active.values())[node_rank]
        if max(local_slots) >= device_count:
            raise ValueError(f"slots {local_slots} of this node exceed the {device_count} visible GPUs")
    return JobPlan(hosts=active,
                   master_addr=master_addr,
                   master_port=args.master_port,
                   fan_out=fan_out,
                   node_rank=node_rank,
                   devices_from_env=devices_from_env)
