# SPDX-License-Identifier: Apache-2.0
"""torch.compile support: which of our hooks compiled code must call instead of tracing.

The ZeRO-3 module hooks gather and release parameters (collectives, ``.data`` swaps):
compiled code must run them eagerly, as graph breaks, never trace them. ``disable(fn)``
marks such a function with ``torch.compiler.disable``. Importing ``torch._dynamo`` costs
about a second, so the mark is applied only once dynamo is loaded: ``torch.compile`` loads
it (so a model compiled before ``deepspeed.initialize`` finds the hooks marked), and
``engine.compile()`` loads it and re-installs the hooks (``UnitCoordinator.reinstall_hooks``).
"""

import sys

import torch


def dynamo_loaded():
    return "torch._dynamo" in sys.modules


def disable(fn):
    """``fn`` marked to run eagerly under torch.compile (as is, while dynamo is not loaded)."""
    if dynamo_loaded():
        return torch.compiler.disable(fn)
    return fn


def is_compile_supported():
    return hasattr(torch, "compile")


def is_compiling():
    """Whether torch.compile is tracing the calling code now (False while dynamo is not loaded)."""
    if not dynamo_loaded():
        return False
    return torch.compiler.is_compiling()
