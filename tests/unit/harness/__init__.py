# SPDX-License-Identifier: Apache-2.0
"""Multi-rank test harness: a pool of live gloo worker processes per world size, reused across tests.

Tests use `tests.unit.common.run_distributed`; this package holds the machinery (`pool`, `worker`, `registry`) and
the result types (`outcome`).
"""

from .outcome import DistributedTestError, RankOutcome, Status
from .registry import get_pool, shutdown_pools
from .worker import in_worker

__all__ = ["DistributedTestError", "RankOutcome", "Status", "get_pool", "shutdown_pools", "in_worker"]
