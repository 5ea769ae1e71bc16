# SPDX-License-Identifier: Apache-2.0
"""``torch_autocast``: train fp32 parameters with the forward under ``torch.autocast`` (upstream's module).

With ``"torch_autocast": {"enabled": true, "dtype": "bf16"}`` the engine runs every forward inside
:func:`autocast_if_enabled`, so matmuls and convolutions compute in the lower precision while parameters,
gradients, masters and optimizer state stay fp32. :func:`init_autocast_params` marks the parameters of the
lower-precision-safe modules (``Linear``, ``Conv1d/2d/3d`` by default, or the classes named in
``lower_precision_safe_modules``) with ``comm_dtype``; upstream reduces those gradients in that dtype. Here
the reduction stays in fp32, where the gradient contract is exact; the mark is kept for code that reads it.

Not built: autocast to fp16, which needs a gradient scaler (upstream's ``torch.amp.GradScaler`` path), raises
``NotImplementedError`` at ``initialize``. Use ``bf16`` or the ``fp16`` section.

If autocast is already on around the engine, the engine's setting wins inside ``forward``: its own dtype when
``torch_autocast`` is enabled, autocast turned off when it is not (DeepSpeed's bf16/fp16 sections then
decide the precision); a one-time message says so.
"""

import importlib
from contextlib import contextmanager
from typing import Iterable, List, Set, Union

import torch

from deepspeed.accelerator import get_accelerator
from deepspeed.utils.logging import logger

LOWER_PRECISION_SAFE_MODULES = [torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d]
PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"

_WARNED_NESTED_AUTOCAST = False
TORCH_AUTOCAST_INITIALIZED = False
TORCH_AUTOCAST_DTYPE = None


def _device_type():
    return get_accelerator().device_name().split(":")[0]


def resolve_autocast_dtype(dtype):
    """``dtype``, or the device's default autocast dtype when None; fp16 raises (see the module docstring)."""
    resolved = dtype if dtype is not None else torch.get_autocast_dtype(_device_type())
    if resolved == torch.float16:
        raise NotImplementedError("torch_autocast with dtype fp16 needs a gradient scaler, which is not built in "
                                  "this runtime; set torch_autocast.dtype to 'bf16', or use the 'fp16' section; see "
                                  "docs/compatibility.md")
    return resolved


def _validate_auto_cast_settings(engine):
    if engine.fp16_enabled() or engine.bfloat16_enabled():
        raise ValueError("torch_autocast.enabled cannot be combined with fp16.enabled or bf16.enabled: autocast "
                         "keeps fp32 parameters")


def _classes(names):
    classes = []
    for name in names:
        try:
            package, class_name = name.rsplit(".", 1)
            classes.append(getattr(importlib.import_module(package), class_name))
        except Exception as err:
            raise ValueError(f"Failed to import lower precision safe module {name}: {err}") from None
    return classes


def init_autocast_params(engine, dtype: torch.dtype,
                         torch_autocast_lower_precision_safe_modules: Union[None, List[str]]) -> None:
    """Mark the parameters of ``engine.module``'s lower-precision-safe modules with ``comm_dtype = dtype``
    (modules matched by exact class) and remember ``dtype`` as the autocast dtype."""
    global TORCH_AUTOCAST_INITIALIZED, TORCH_AUTOCAST_DTYPE
    _validate_auto_cast_settings(engine)
    names = torch_autocast_lower_precision_safe_modules
    classes = LOWER_PRECISION_SAFE_MODULES if names is None else _classes(names)
    for module in engine.module.modules():
        if type(module) in classes:
            for param in module.parameters(recurse=False):
                setattr(param, PARAM_COMM_DTYPE_ATTR_NAME, dtype)
    TORCH_AUTOCAST_INITIALIZED = True
    TORCH_AUTOCAST_DTYPE = dtype


def is_autocast_initialized() -> bool:
    return TORCH_AUTOCAST_INITIALIZED


def get_default_autocast_lower_precision_modules() -> List[str]:
    return [f"{cls.__module__}.{cls.__name__}" for cls in LOWER_PRECISION_SAFE_MODULES]


def get_autocast_dtype() -> torch.dtype:
    return TORCH_AUTOCAST_DTYPE


def has_comm_dtype(param: torch.nn.Parameter) -> bool:
    return hasattr(param, PARAM_COMM_DTYPE_ATTR_NAME)


def get_comm_dtype(param: torch.nn.Parameter) -> torch.dtype:
    """The dtype ``param``'s gradient is communicated in upstream: its ``comm_dtype`` mark, else its dtype."""
    return getattr(param, PARAM_COMM_DTYPE_ATTR_NAME, param.dtype)


def get_all_comm_dtypes(params: Iterable) -> Set[torch.dtype]:
    return {get_comm_dtype(p) for p in params}


def sort_dtypes(dtypes: List[torch.dtype]) -> List[torch.dtype]:
    """``dtypes`` in a fixed order (by name), the same on every rank."""
    return sorted(dtypes, key=str)


def _note_nested(message, level):
    global _WARNED_NESTED_AUTOCAST
    if not _WARNED_NESTED_AUTOCAST:
        _WARNED_NESTED_AUTOCAST = True
        import deepspeed.comm as dist
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.log(level, message)


@contextmanager
def autocast_if_enabled(engine):
    """The engine's autocast setting for the body (see the module docstring)."""
    import logging
    device_type = _device_type()
    enabled = engine.torch_autocast_enabled()
    if torch.is_autocast_enabled(device_type):
        if enabled:
            _note_nested(
                "torch.autocast is already enabled outside DeepSpeed; the engine's forward follows the "
                "`torch_autocast` section of its config", logging.INFO)
        else:
            _note_nested(
                "torch.autocast is enabled outside DeepSpeed but disabled within the DeepSpeed engine; "
                "the engine's forward runs without autocast (set the `torch_autocast` section to use it)",
                logging.WARNING)
            with torch.autocast(device_type=device_type, enabled=False):
                yield
            return
    if enabled:
        with torch.autocast(device_type=device_type, dtype=engine.torch_autocast_dtype(), enabled=True):
            yield
    else:
        yield
