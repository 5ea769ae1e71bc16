# SPDX-License-Identifier: Apache-2.0
"""``--bind_cores_to_rank``: a worker takes its share of the node's cores, then becomes the training script.

torchrun starts ``python -m deepspeed.launcher.core_binding [--module|--no_python] [--bind_core_list=L] script
args...`` as each worker; it binds itself (``os.sched_setaffinity``) to the ``LOCAL_RANK``-th of
``LOCAL_WORLD_SIZE`` equal, contiguous shares of the cores (``L``, e.g. ``0-7,16-23``, or every core this process
may use), sets ``OMP_NUM_THREADS`` to the share's size, and replaces itself with the script (the binding is
inherited). Unlike upstream it does not run ``numactl``, so memory is not bound to a NUMA node.
"""

import os
import sys
from typing import List, Optional, Sequence


def parse_range_list(text: str) -> List[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]``; a malformed list raises ValueError."""
    cores: List[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, sep, high = part.partition("-")
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise ValueError(f"core range {part!r} runs backwards")
        cores.extend(range(first, last + 1))
    if not cores:
        raise ValueError(f"no cores in {text!r}")
    return cores


def cores_for_rank(cores: Sequence[int], local_rank: int, local_size: int) -> List[int]:
    """The ``local_rank``-th of ``local_size`` equal contiguous shares (leftover cores stay unused)."""
    per_rank = len(cores) // local_size
    if per_rank < 1:
        raise ValueError(f"{len(cores)} cores cannot be shared by {local_size} ranks (one core each at least)")
    return list(cores[per_rank * local_rank:per_rank * (local_rank + 1)])


def _script_command(args: Sequence[str]) -> List[str]:
    mode, rest = None, list(args)
    if rest and rest[0] in ("--module", "--no_python"):
        mode, rest = rest[0], rest[1:]
    if mode == "--no_python":
        return rest
    return [sys.executable, "-u"] + (["-m"] if mode == "--module" else []) + rest


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = [argv.pop(0)] if argv and argv[0] in ("--module", "--no_python") else []
    core_list = None
    if argv and argv[0].startswith("--bind_core_list="):
        core_list = argv.pop(0).split("=", 1)[1]
    cores = parse_range_list(core_list) if core_list else sorted(os.sched_getaffinity(0))
    mine = cores_for_rank(cores, int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))
    command = _script_command(mode + argv)
    sys.stdout.flush()
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
