# SPDX-License-Identifier: Apache-2.0
"""What unit tests import to run code on several ranks: `run_distributed` and the `distributed_test` decorator.

Both run a module-level function on every rank of a live gloo worker pool (one pool per world size, reused for the
whole pytest session; see `tests.unit.harness`). Inside the function `torch.distributed` is initialized, the usual
launcher environment is set, torch runs with one thread and the RNGs are seeded with 1234 + rank.
"""

import functools
import importlib
from typing import Any, Callable, Dict, List, Optional, Sequence

from tests.unit.harness import DistributedTestError, get_pool, in_worker

__all__ = ["DistributedTestError", "run_distributed", "distributed_test"]

DEFAULT_TIMEOUT_S = 120.0


def run_distributed(fn: Callable,
                    world_size: int = 2,
                    args: Sequence = (),
                    kwargs: Optional[Dict[str, Any]] = None,
                    timeout: float = DEFAULT_TIMEOUT_S) -> List[Any]:
    """Run fn(*args, **kwargs) on `world_size` ranks and return the per-rank return values (index = rank).

    `fn` must be a module-level function (it is pickled by reference); args, kwargs and results must pickle.
    Before each call every rank has: torch.distributed initialized (gloo, rank/world of the pool); RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT in os.environ (the environment and cwd a previous call
    changed are restored); torch.set_num_threads(1); torch, random and numpy seeded with 1234 + rank.

    Raises DistributedTestError (an AssertionError) if any rank raised, died or did not answer within `timeout`
    seconds; its message lists every rank's outcome (ok / traceback / no reply) and the tail of each rank's output.
    Ranks that did not answer are killed together with their whole pool, which restarts on the next call; after a
    rank raised, the others get a short grace period, not the full timeout. Expected exceptions should be caught
    inside `fn`: a raising rank may cost a pool restart (a few seconds).
    """
    if in_worker():
        raise RuntimeError("run_distributed cannot be called from inside a pool worker")
    return get_pool(world_size).call(fn, args, kwargs, timeout=timeout)


class _Unwrapped:
    """Picklable reference to the function a `distributed_test` wrapper replaced in its module.

    Pickle resolves functions by module and qualified name, which now names the wrapper; the worker follows
    `__wrapped__` back to the original so that it runs the body, not another pool call.
    """

    def __init__(self, module: str, qualname: str):
        self.module = module
        self.qualname = qualname

    def resolve(self) -> Callable:
        target = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            target = getattr(target, part)
        return getattr(target, "__wrapped__", target)

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{self.module}.{self.qualname}"


def distributed_test(world_size: int = 2, timeout: float = DEFAULT_TIMEOUT_S):
    """Decorate a module-level function so that calling it runs it on `world_size` ranks.

    The decorated function returns the per-rank results like `run_distributed`, except that it returns None when
    every rank returned None, so it can decorate a pytest test function directly (pytest parameters and picklable
    fixtures such as tmp_path are passed through to every rank).
    """

    def decorate(fn: Callable) -> Callable:
        target = _Unwrapped(fn.__module__, fn.__qualname__)

        @functools.wraps(fn)
        def run_on_all_ranks(*args, **kwargs):
            results = run_distributed(target, world_size, args, kwargs, timeout)
            return None if all(result is None for result in results) else results

        return run_on_all_ranks

    return decorate
