# SPDX-License-Identifier: Apache-2.0
"""NUMA binding for CPU ranks: which cores each NUMA node has, and the ``numactl`` prefix of a rank.

``get_numactl_cmd(bind_core_list, num_local_procs, local_rank)`` splits the cores (``bind_core_list`` as
``"0-3,8-11"``, else every physical core) evenly over the local ranks and returns
``(cores_per_rank, ["numactl", <memory binding>, "-C", "<cores>"])``. The memory binding is ``-m <node>``
when the rank's cores sit in one node; on flat-HBM machines (as many CPU-less nodes as nodes with CPUs, the
i-th CPU-less node being the i-th node's HBM) it is ``-p <hbm node>``; where several nodes report the same
CPU list (fake NUMA) it is ``-m`` over all of them.
"""

import os
import shutil
import subprocess


def get_numa_cores():
    """The cores of every NUMA node as ``numactl --hardware`` reports them (``[]`` without numactl)."""
    try:
        text = subprocess.check_output(["numactl", "--hardware"]).decode("utf-8")
    except (FileNotFoundError, subprocess.SubprocessError):
        return []
    lines = text.split("\n")
    nodes = 0
    for line in lines:
        if line.startswith("available:"):
            nodes = int(line.split()[1])
            break
    cores = []
    for node in range(nodes):
        prefix = f"node {node} cpus:"
        found = [line[len(prefix):].split() for line in lines if line.startswith(prefix)]
        cores.append([int(c) for c in found[0]] if found else [])
    return cores


def check_for_numactl_pkg():
    """Whether the system's package manager (dpkg, pacman or rpm: the first found) has numactl installed."""
    managers = (("dpkg", "-l", "apt"), ("pacman", "-Q", "pacman"), ("rpm", "-q", "yum"))
    for manager, flag, tool in managers:
        if shutil.which(manager) is None:
            continue
        done = subprocess.run([manager, flag, "numactl"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if done.returncode == 0:
            return True
        print(f"please install the numactl package with {tool}")
        return False
    return False


def parse_range(rng):
    """``"5"`` -> ``range(5, 6)``, ``"2-4"`` -> ``range(2, 5)``; anything else raises ``ValueError``."""
    try:
        value = int(rng)
        return range(value, value + 1)
    except ValueError:
        pass
    bounds = rng.split("-")
    if len(bounds) != 2:
        raise ValueError(f"Bad range: '{rng}', range must be either a number or two number separated by dash")
    start, end = int(bounds[0]), int(bounds[1])
    if start > end:
        raise ValueError(f"Bad range: '{rng}', range end must larger than or equal to start")
    return range(start, end + 1)


def parse_range_list(range_str):
    """``"0,2-4"`` -> ``[0, 2, 3, 4]``; sub-ranges must ascend and not overlap (else ``ValueError``)."""
    numbers = []
    for piece in range_str.split(","):
        sub = parse_range(piece)
        if numbers and sub[0] <= numbers[-1]:
            raise ValueError(f"Bad range: '{range_str}', sub ranges must not overlap with each other and should "
                             f"be in ascend order")
        numbers.extend(sub)
    return numbers


def _physical_cores():
    try:
        import psutil
        count = psutil.cpu_count(logical=False)
        if count:
            return count
    except ImportError:
        pass
    return os.cpu_count() or 1


def _memory_binding(rank_cores, numa_cores):
    """The ``numactl`` memory option for a rank whose cores are ``rank_cores`` (``[]`` if none applies)."""
    with_cpus = [i for i, cores in enumerate(numa_cores) if cores]
    without_cpus = [i for i, cores in enumerate(numa_cores) if not cores]
    home = next((i for i, cores in enumerate(numa_cores) if cores and set(rank_cores) <= set(cores)), None)
    if home is None:
        return []
    if without_cpus and len(without_cpus) == len(with_cpus):  # flat HBM: node i's memory is its CPU-less twin
        return ["-p", str(dict(zip(with_cpus, without_cpus))[home])]
    twins = [i for i, cores in enumerate(numa_cores) if cores == numa_cores[home]]
    return ["-m", ",".join(str(i) for i in twins)]


def _core_list_string(cores):
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    pieces, start, last = [], cores[0], cores[0]
    for core in list(cores[1:]) + [None]:
        if core is not None and core == last + 1:
            last = core
            continue
        pieces.append(str(start) if start == last else f"{start}-{last}")
        start = last = core
    return ",".join(pieces)


def get_numactl_cmd(bind_core_list, num_local_procs, local_rank):
    """``(cores_per_rank, numactl command prefix)`` for ``local_rank`` (see the module docstring)."""
    check_for_numactl_pkg()
    if "KMP_AFFINITY" in os.environ:
        raise ValueError("Environment variable KMP_AFFINITY conflicts with numactl because it interferes with how "
                         "many CPU cores numactl can set. Unset KMP_AFFINITY before launching deepspeed.")
    cores = parse_range_list(bind_core_list) if bind_core_list is not None else list(range(_physical_cores()))
    cores_per_rank = len(cores) // num_local_procs
    if cores_per_rank < 1:
        raise ValueError(f"At least one core needs to be assigned to each rank: {len(cores)} cores for "
                         f"{num_local_procs} local ranks")
    rank_cores = list(cores[cores_per_rank * local_rank:cores_per_rank * (local_rank + 1)])
    command = ["numactl"] + _memory_binding(rank_cores, get_numa_cores())
    command += ["-C", _core_list_string(rank_cores)]
    return cores_per_rank, command
