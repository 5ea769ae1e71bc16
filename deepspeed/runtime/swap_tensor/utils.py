# SPDX-License-Identifier: Apache-2.0
"""Swap-buffer helpers of NVMe swapping: the size constants, and the buffer classes (not built)."""

from deepspeed.runtime.not_built import not_built_class, not_built_function

MIN_AIO_BYTES = 1024**2
AIO_ALIGNED_BYTES = 1024
MIN_SWAPPABLE_BYTES = MIN_AIO_BYTES

_FEATURE = "NVMe tensor swapping"
SwapBuffer = not_built_class("SwapBuffer", _FEATURE, module=__name__)
SwapBufferPool = not_built_class("SwapBufferPool", _FEATURE, module=__name__)
SwapBufferManager = not_built_class("SwapBufferManager", _FEATURE, module=__name__)
swap_in_tensors = not_built_function("swap_in_tensors", _FEATURE, module=__name__)
swap_out_tensors = not_built_function("swap_out_tensors", _FEATURE, module=__name__)


def get_sized_buffer(buffer, num_elems):
    """The first ``num_elems`` elements of ``buffer`` (a view)."""
    if num_elems > buffer.numel():
        raise ValueError(f"num_elems {num_elems} > buffer {buffer.numel()}")
    return buffer.narrow(0, 0, num_elems) if num_elems < buffer.numel() else buffer


def get_sized_buffers(buffer_list, num_elems_list):
    return [get_sized_buffer(b, n) for b, n in zip(buffer_list, num_elems_list)]
