# SPDX-License-Identifier: Apache-2.0
"""The session-wide set of worker pools: one per world size, created on first use, closed once at the end.

`shutdown_pools` runs from atexit and from the pytest session-finish hook (whichever comes first; the second finds
nothing to do). Only the process that created the pools closes them, so a forked child exiting cannot tear down the
parent's workers.
"""

import atexit
import os
from typing import Dict

from .pool import WorkerPool

_pools: Dict[int, WorkerPool] = {}
_owner_pid = os.getpid()


def get_pool(world_size: int) -> WorkerPool:
    """The pool for `world_size` (not started yet if it has never run or was killed)."""
    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = WorkerPool(world_size)
    return pool


def shutdown_pools() -> None:
    """Stop every pool's workers; afterwards `get_pool` may start fresh ones."""
    if os.getpid() != _owner_pid:
        return
    pools = list(_pools.values())
    _pools.clear()
    for pool in pools:
        pool.request_stop()
    for pool in pools:
        pool.close()


atexit.register(shutdown_pools)
