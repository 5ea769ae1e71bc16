# SPDX-License-Identifier: Apache-2.0
"""Selection of the process-wide accelerator.

``get_accelerator()`` returns one accelerator object per process, chosen on
first use: ``DS_ACCELERATOR`` ("cuda" or "cpu") when set, else CUDA when
``torch.cuda.is_available()``, else CPU. ``set_accelerator`` replaces it (for
tests, or for a caller that selects the device itself).
"""

import os

SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu"]

ds_accelerator = None


def _make_accelerator(name):
    if name == "cuda":
        from .cuda_accelerator import CUDA_Accelerator
        return CUDA_Accelerator()
    from .cpu_accelerator import CPU_Accelerator
    return CPU_Accelerator()


def _select_name():
    import torch
    name = os.environ.get("DS_ACCELERATOR")
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    name = name.strip().lower()
    if name not in SUPPORTED_ACCELERATOR_LIST:
        raise ValueError(f"DS_ACCELERATOR={name!r} is not supported; choose one of {SUPPORTED_ACCELERATOR_LIST}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("DS_ACCELERATOR=cuda but torch.cuda.is_available() is False")
    return name


def get_accelerator():
    """The process-wide accelerator (created on the first call)."""
    global ds_accelerator
    if ds_accelerator is None:
        ds_accelerator = _make_accelerator(_select_name())
    return ds_accelerator


def set_accelerator(accel_obj):
    """Make ``accel_obj`` (a ``DeepSpeedAccelerator``) the process-wide accelerator."""
    global ds_accelerator
    ds_accelerator = accel_obj


def is_current_accelerator_supported():
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST
