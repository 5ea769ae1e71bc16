# SPDX-License-Identifier: Apache-2.0
"""Version gates and small torch helpers, under upstream's names (``deepspeed.utils.torch``)."""

import torch
from packaging import version as _version


def required_torch_version(min_version=None, max_version=None):
    """Whether the installed torch lies within ``[min_version, max_version]`` (either bound may be left out).

    Bounds are versions as numbers or strings (``2.1``, ``"2.4.0"``); local suffixes such as ``+cpu`` of the
    installed version are compared as PEP 440 says (``2.4.0+cpu`` is not below ``2.4``). At least one bound
    is required.
    """
    if not min_version and not max_version:
        raise ValueError("required_torch_version needs min_version or max_version")
    installed = _version.parse(torch.__version__)
    if min_version and installed < _version.parse(str(min_version)):
        return False
    if max_version and installed > _version.parse(str(max_version)):
        return False
    return True


def register_grad_hook(param, hook):
    """Run ``hook(param)`` each time a gradient has been accumulated into ``param.grad``; returns the handle."""
    return param.register_post_accumulate_grad_hook(hook)


def is_functorch_transforming():
    """Whether a functorch transform (vmap, grad, ...) is running now (compiled or eager)."""
    try:
        from torch._C._functorch import is_functorch_wrapped_tensor, peek_interpreter_stack  # noqa: F401
    except ImportError:
        return False
    return peek_interpreter_stack() is not None


def jit_script_compat(fn):
    """``torch.jit.script(fn)`` where TorchScript works, ``fn`` itself where it is deprecated or fails."""
    if required_torch_version(min_version=2.4):
        return fn
    try:
        return torch.jit.script(fn)
    except Exception:  # TorchScript cannot compile everything; eager is always correct
        return fn
