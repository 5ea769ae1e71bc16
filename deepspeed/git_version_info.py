# SPDX-License-Identifier: Apache-2.0
"""Version and build facts of this install, under upstream's names.

``version``, ``git_hash``, ``git_branch``: from ``deepspeed/git_version_info_installed.py`` when ``setup.py``
wrote it into an installed package, else from the checkout's git (``"unknown"`` without git).
``installed_ops``: op name -> whether the op was prebuilt into this install (``DS_BUILD_OPS=1``).
``compatible_ops``: op name -> whether the op can be built here (its compiler, CUDA and torch are there), plus
upstream's ``deepspeed_not_implemented: False``. ``torch_info``: the torch the ops were built with (``version``,
``cuda_version``, ``hip_version``, ``nccl_version`` as ``"major.minor"``, ``"0.0"`` when absent; ``bf16_support``),
or the running torch when no op was prebuilt.
``accelerator_name``: ``"cuda"`` or ``"cpu"``.

Everything but ``version`` is computed on first access, so importing this module costs nothing.
"""

import os
import subprocess

try:
    from deepspeed import git_version_info_installed as _installed
except ImportError:
    _installed = None

_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_computed = {}


def _read_version():
    if _installed is not None:
        return _installed.version
    from deepspeed import __version__
    return __version__


def _git(*args):
    if not os.path.exists(os.path.join(_CHECKOUT, ".git")):
        return None
    try:
        out = subprocess.run(["git", "-C", _CHECKOUT] + list(args), capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _major_minor(text):
    return ".".join(str(text).split(".")[:2]) if text else "0.0"


def current_torch_info():
    """``torch_info`` of the running torch."""
    import torch
    nccl = "0.0"
    try:
        if torch.cuda.is_available():
            nccl = _major_minor(".".join(map(str, torch.cuda.nccl.version())))
    except (AttributeError, RuntimeError, TypeError):
        pass
    bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return {
        "version": _major_minor(torch.__version__.split("+")[0]),
        "bf16_support": bf16,
        "cuda_version": _major_minor(torch.version.cuda),
        "nccl_version": nccl,
        "hip_version": _major_minor(getattr(torch.version, "hip", None)),
    }


def _compute(name):
    if name in ("git_hash", "git_branch"):
        if _installed is not None:
            return getattr(_installed, name)
        if name == "git_hash":
            return _git("rev-parse", "--short", "HEAD") or "unknown"
        return _git("rev-parse", "--abbrev-ref", "HEAD") or "unknown"
    from deepspeed.ops.op_builder import ALL_OPS
    if name == "installed_ops":
        return {op: builder.is_installed() for op, builder in ALL_OPS.items()}
    if name == "compatible_ops":
        compatible = {op: builder.is_compatible() for op, builder in ALL_OPS.items()}
        compatible["deepspeed_not_implemented"] = False
        return compatible
    if name == "torch_info":
        built_with = getattr(_installed, "torch_info", None)
        return dict(built_with) if built_with else current_torch_info()
    if name == "accelerator_name":
        from deepspeed.accelerator import get_accelerator
        return get_accelerator().device_name()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_LAZY = ("git_hash", "git_branch", "installed_ops", "compatible_ops", "torch_info", "accelerator_name")
version = _read_version()


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _computed:
        _computed[name] = _compute(name)
    return _computed[name]


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
