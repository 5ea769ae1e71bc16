# SPDX-License-Identifier: Apache-2.0
"""A process-wide count of host memory pinned through ``get_accelerator().pin_memory``.

Pinned pages cannot be swapped and count against ``ulimit -l``; a host running out of memory far from where the
memory was pinned is easier to explain with this total. Each doubling past 32 GiB is logged at INFO, each
allocation at DEBUG; ``pinned_memory_summary(tag)`` logs the total.
"""

from deepspeed.utils.logging import logger

_GB = 1024**3
_CHECKPOINT_BASE_GB = 32


def _fmt_bytes(num_bytes: int) -> str:
    for unit, size, digits in (("GB", 1024**3, 3), ("MB", 1024**2, 2), ("KB", 1024, 1)):
        if num_bytes >= size:
            return f"{num_bytes / size:.{digits}f} {unit}"
    return f"{num_bytes} B"


class _PinnedMemoryTracker:
    """Running total of pinned bytes and allocations (see the module docstring)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._bytes = 0
        self._calls = 0
        self._next_checkpoint = _CHECKPOINT_BASE_GB * _GB

    def track(self, num_bytes: int) -> None:
        self._bytes += int(num_bytes)
        self._calls += 1
        logger.debug(f"pin_memory: +{_fmt_bytes(num_bytes)} (call #{self._calls}, running total: "
                     f"{_fmt_bytes(self._bytes)})")
        while self._bytes >= self._next_checkpoint:
            logger.info(f"[pinned-memory checkpoint] crossed {_fmt_bytes(self._next_checkpoint)}: "
                        f"{_fmt_bytes(self._bytes)} pinned across {self._calls} allocations")
            self._next_checkpoint *= 2

    def log_summary(self, tag: str = "") -> None:
        prefix = f"[pinned-memory {tag}] " if tag else "[pinned-memory] "
        logger.info(f"{prefix}{_fmt_bytes(self._bytes)} pinned across {self._calls} allocations")


_tracker = _PinnedMemoryTracker()


def track_pinned_memory(num_bytes: int) -> None:
    """Add ``num_bytes`` newly pinned bytes to the total."""
    _tracker.track(num_bytes)


def pinned_memory_summary(tag: str = "") -> None:
    """Log the total pinned so far (``tag`` names the point of the run)."""
    _tracker.log_summary(tag)
