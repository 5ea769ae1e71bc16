# SPDX-License-Identifier: Apache-2.0
"""The ``DeepSpeed`` logger and rank-aware logging helpers.

Every record carries the process's global rank (``[Rank N]``), read from
torch.distributed once it is initialised and from ``RANK`` before that, so
interleaved output of several processes can be told apart. The logger does not
propagate to the root logger, so applications that configure logging do not
print our records twice.
"""

import functools
import json
import logging
import os
import sys

log_levels = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

LOG_FORMAT = "[%(asctime)s] [%(levelname)s] [Rank %(rank)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"


def _global_rank():
    """The global rank, or -1 when distributed is not initialised and ``RANK`` is unset."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return int(os.environ.get("RANK", -1))


class _RankFilter(logging.Filter):
    """Adds ``record.rank`` to every record (0 for a process that is not part of a job)."""

    def filter(self, record):
        record.rank = max(_global_rank(), 0)
        return True


class LoggerFactory:

    @staticmethod
    def create_logger(name=None, level=logging.INFO):
        """A logger writing rank-tagged records to stdout, not propagating to the root logger."""
        if name is None:
            raise ValueError("name for logger cannot be None")
        logger_ = logging.getLogger(name)
        logger_.setLevel(level)
        logger_.propagate = False
        if not any(isinstance(f, _RankFilter) for h in logger_.handlers for f in h.filters):
            handler = logging.StreamHandler(stream=sys.stdout)
            handler.setFormatter(logging.Formatter(LOG_FORMAT))
            handler.addFilter(_RankFilter())
            logger_.addHandler(handler)
        return logger_


logger = LoggerFactory.create_logger(name="DeepSpeed", level=logging.INFO)


@functools.lru_cache(maxsize=None)
def warning_once(*args, **kwargs):
    """``logger.warning``, but each distinct message is emitted once per process."""
    logger.warning(*args, **kwargs)


logger.warning_once = warning_once


def _should_log(ranks):
    """None or a -1 in ``ranks`` means every rank; otherwise only the listed global ranks log."""
    if ranks is None:
        return True
    rank = _global_rank()
    return rank < 0 or -1 in ranks or rank in ranks


def log_dist(message, ranks=None, level=logging.INFO):
    """Log ``message`` at ``level`` on the listed global ranks (all ranks when ``ranks`` is None or holds -1).

    A process outside a distributed job always logs.
    """
    if _should_log(ranks):
        logger.log(level, message, stacklevel=2)


@functools.lru_cache(maxsize=None)
def _log_once(message, ranks, level):
    log_dist(message, ranks=None if ranks is None else list(ranks), level=level)


def log_dist_once(message, ranks=None, level=logging.INFO):
    """:func:`log_dist`, but each distinct (message, ranks, level) is logged once per process."""
    _log_once(message, None if ranks is None else tuple(ranks), level)


def print_rank_0(message):
    """Print ``message`` on global rank 0 only (and in a process outside a distributed job)."""
    if _global_rank() <= 0:
        print(message, flush=True)


def print_json_dist(message, ranks=None, path=None):
    """Write ``message`` (a dict) as JSON to ``path`` on the listed ranks, adding the writer's ``rank``."""
    if _should_log(ranks):
        message = dict(message, rank=max(_global_rank(), 0))
        with open(path, "w") as outfile:
            json.dump(message, outfile)


def get_current_level():
    """The effective level of the DeepSpeed logger."""
    return logger.getEffectiveLevel()


def get_log_level_from_string(log_level_str):
    try:
        return log_levels[log_level_str.lower()]
    except KeyError:
        raise ValueError(f"{log_level_str} is not one of the log levels {list(log_levels)}") from None


def set_log_level_from_string(log_level_str, custom_logger=None):
    """Set the level of ``custom_logger`` (default: the DeepSpeed logger) and of its handlers, from a name
    (``"debug"``, ``"info"``, ``"warning"``, ``"error"``, ``"critical"``, any case)."""
    target = logger if custom_logger is None else custom_logger
    level = get_log_level_from_string(log_level_str)
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def should_log_le(max_log_level_str):
    """True when the logger would emit records at ``max_log_level_str`` (its level is at or below it)."""
    if not isinstance(max_log_level_str, str):
        raise ValueError(f"{max_log_level_str} is not a string")
    return get_current_level() <= get_log_level_from_string(max_log_level_str)
