# SPDX-License-Identifier: Apache-2.0
"""Host buffers for the aio handle: aligned to 4096 bytes (what ``O_DIRECT`` needs), page-locked where a GPU is.

:func:`aligned_empty` over-allocates a byte tensor by one alignment and returns the aligned view of it, so the memory
belongs to torch (views keep it alive) and no allocator rounds it up (torch's pinned allocator rounds every request
to a power of two). Where CUDA is available and ``pin`` is asked for, the aligned range is registered with the
driver (``cudaHostRegister``): asynchronous copies to and from the device then run without staging, as from torch's
own pinned memory; the registration is undone when the last view is gone, or by :func:`free_aligned`.
"""

import weakref

import torch

from deepspeed.ops.aio.backends import ALIGNMENT

_registered = {}  # data_ptr of a registered range -> its finalizer


def is_aligned(tensor):
    """Whether ``tensor``'s first byte sits on an :data:`ALIGNMENT` boundary."""
    return tensor.data_ptr() % ALIGNMENT == 0


def aligned_numel(numel, dtype):
    """``numel`` rounded up so that ``numel`` elements of ``dtype`` fill whole :data:`ALIGNMENT` blocks."""
    per_block = max(1, ALIGNMENT // torch.empty((), dtype=dtype).element_size())
    return -(-int(numel) // per_block) * per_block


def _unregister(address):
    _registered.pop(address, None)
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # the process is ending, or CUDA went away: nothing to undo
        pass


def aligned_empty(numel, dtype=torch.uint8, pin=True):
    """A flat uninitialised CPU tensor of ``numel`` elements whose data starts on an :data:`ALIGNMENT` boundary;
    page-locked (registered with CUDA) when ``pin`` and a GPU is available."""
    element = torch.empty((), dtype=dtype).element_size()
    nbytes = int(numel) * element
    span = -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT
    raw = torch.empty(span + ALIGNMENT, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % ALIGNMENT
    tensor = raw.narrow(0, shift, nbytes).view(dtype) if nbytes else torch.empty(0, dtype=dtype)
    if pin and nbytes and torch.cuda.is_available():
        address = raw.data_ptr() + shift
        status = torch.cuda.cudart().cudaHostRegister(address, span, 0)
        if int(status) == 0:
            _registered[address] = weakref.finalize(raw, _unregister, address)
    return tensor


def free_aligned(tensor):
    """Undo the page-locking of a tensor of :func:`aligned_empty` now (its memory goes when the last view does)."""
    finalizer = _registered.pop(tensor.data_ptr(), None)
    if finalizer is not None:
        finalizer()


def host_address(tensor):
    """The address of a contiguous CPU tensor's data; ValueError for anything else."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"aio: expected a tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"aio: expected a CPU tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("aio: the tensor must be contiguous")
    return tensor.data_ptr()
