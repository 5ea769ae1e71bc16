# SPDX-License-Identifier: Apache-2.0
"""The comms logger's hook into ``deepspeed.comm``: :func:`timed_op` wraps each collective.

With the logger off (the default) a wrapped collective costs one attribute test before it runs. With it on, a
selected call (see :meth:`CommsLogger.selects`) is timed from a device synchronisation before the call to one after
its completion (an asynchronous collective is waited for: the work handle returned is already complete) and
recorded with the bytes this rank sends. Every collective also accepts upstream's optional keyword arguments
``prof`` (time this call even if the logger does not select it), ``log_name`` (the record name) and ``debug``
(append the caller's function name to the record name).
"""

import functools
import inspect
import time

from deepspeed.comm import peer_failure

from deepspeed.utils.comms_logging import CommsLogger, caller_name

# The process's logger, shared by every collective; deepspeed.comm.configure sets it up.
comms_logger = CommsLogger()


def _nbytes(tensor):
    return tensor.element_size() * tensor.nelement() if tensor is not None else 0


def _sum_nbytes(tensors):
    return sum(_nbytes(t) for t in (tensors or ()))


def size_of(name):
    """A function of the bound arguments: the bytes this rank sends in collective ``name``."""
    if name in ("barrier", "monitored_barrier"):
        return lambda args: 0
    if name in ("all_reduce_coalesced", ):
        return lambda args: _sum_nbytes(args["tensors"])
    if name == "reduce_scatter":
        return lambda args: _sum_nbytes(args["input_list"])
    if name == "all_to_all":
        return lambda args: _sum_nbytes(args["input_tensor_list"])
    if name in ("reduce_scatter_tensor", "all_gather_into_tensor"):
        return lambda args: _nbytes(args["input_tensor"])
    return lambda args: _nbytes(args["tensor"])


def _synchronize():
    from deepspeed.accelerator import get_accelerator
    get_accelerator().synchronize()


def timed_op(fn):
    """Decorate collective ``fn`` (named as upstream names the collective) for the comms logger."""
    name = fn.__name__
    signature = inspect.signature(fn)
    measure = size_of(name)
    params = list(signature.parameters)
    async_at = params.index("async_op") if "async_op" in params else None
    group_at = params.index("group") if "group" in params else None

    @functools.wraps(fn)
    def collective(*args, prof=False, log_name=None, debug=None, **kwargs):
        if not comms_logger.enabled:
            if peer_failure.watching():  # gloo: waits read the store between slices (a peer may have failed)
                return peer_failure.call_watched(fn, args, kwargs, async_at, group_at)
            return fn(*args, **kwargs)
        if not (prof or comms_logger.selects(name) or (log_name is not None and comms_logger.selects(log_name))):
            return fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        _synchronize()
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        if result is not None and hasattr(result, "wait"):
            result.wait()
        _synchronize()
        latency_ms = (time.perf_counter() - start) * 1e3
        record_name = log_name or name
        if debug or (debug is None and comms_logger.debug):
            record_name = f"{record_name} | [Caller Func: {caller_name(1)}]"
        comms_logger.append(name, record_name, latency_ms, measure(bound.arguments))
        return result

    return collective
