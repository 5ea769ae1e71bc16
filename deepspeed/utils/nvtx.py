# SPDX-License-Identifier: Apache-2.0
"""``instrument_w_nvtx``: a decorator that wraps each call of a function in an accelerator range (NVTX on CUDA).

The range is named after the function's ``__qualname__``; it is skipped while ``torch.compile`` traces (a range
push would break the graph) and when ``enable_nvtx`` is set to False.
"""

import functools

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.compiler import is_compiling

enable_nvtx = True
DEEPSPEED_NVTX_DOMAIN = "DeepSpeed"


def _range_push(accelerator, msg):
    if getattr(accelerator, "supports_nvtx_domain", False):
        return accelerator.range_push(msg, domain=DEEPSPEED_NVTX_DOMAIN)
    return accelerator.range_push(msg)


def _range_pop(accelerator):
    if getattr(accelerator, "supports_nvtx_domain", False):
        return accelerator.range_pop(domain=DEEPSPEED_NVTX_DOMAIN)
    return accelerator.range_pop()


def instrument_w_nvtx(func):
    """``func`` with an accelerator range around every call (popped also when ``func`` raises)."""

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        if not enable_nvtx or is_compiling():
            return func(*args, **kwargs)
        accelerator = get_accelerator()
        _range_push(accelerator, func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            _range_pop(accelerator)

    return wrapped
