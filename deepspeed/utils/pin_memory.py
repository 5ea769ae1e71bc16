# SPDX-License-Identifier: Apache-2.0
"""Host memory pinned by its own allocation instead of torch's caching host allocator (upstream's
``DS_PIN_MEMORY_BACKEND=native``).

torch's pinned allocator rounds every request up to a power of two (a 4,097 MiB buffer takes 8 GiB of page-locked
memory). :class:`NativePinnedMemory` maps exactly the pages a tensor needs (an anonymous ``mmap``), locks them in RAM
(``mlock``) and, where a CUDA runtime exists, registers them with it (``cudaHostRegister``), so device copies from
and to them are asynchronous as from torch's pinned memory. It remembers each allocation's address range:

* ``pin(tensor, make_copy=True, match_shape=True)``: a pinned tensor of ``tensor``'s dtype (its values unless
  ``make_copy=False``; its shape unless ``match_shape=False``, then flat), marked ``ds_pinned``;
  ``pin_empty(example, shape)``: an uninitialised one of ``example``'s dtype;
* ``is_pinned(tensor)``: whether the tensor's data lies in a live allocation (views and slices included; False for
  tensors without storage, meta or fake);
* ``unpin(tensor)``: unlock and forget the allocation ``tensor`` was pinned into (also after its ``.data`` was
  rebound elsewhere); True if there was one. The memory itself is freed with the last tensor or view that uses it
  (an allocation no tensor uses any more is unlocked and forgotten then, without ``unpin``).

``get_active_native_pinned_memory()`` is the shared instance when ``DS_PIN_MEMORY_BACKEND=native``, else None; the
accelerators' ``pin_memory`` / ``is_pinned`` / ``unpin_memory`` use it then. Locking needs the locked-memory limit
(``ulimit -l``) to cover the allocation; an allocation it does not cover raises, naming the limit.
"""

import ctypes
import mmap
import os
import weakref

import torch

_shared_native_pins = None
_libc = None


def _lib():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _cuda_register(address, nbytes):
    if not torch.cuda.is_available():
        return False
    status = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    if int(status) != 0:
        raise RuntimeError(f"NativePinnedMemory: cudaHostRegister of {nbytes} bytes failed (error {int(status)})")
    return True


def _release(begin, nbytes, registered, ranges, finalizers):
    """Unlock (and unregister) an allocation and forget it; its memory is unmapped by its owner."""
    if ranges.pop(begin, None) is None:
        return
    finalizers.pop(begin, None)
    if registered:
        torch.cuda.cudart().cudaHostUnregister(begin)
    _lib().munlock(ctypes.c_void_p(begin), ctypes.c_size_t(nbytes))


class NativePinnedMemory:
    """Page-locked host allocations of their exact size (see the module docstring)."""

    def __init__(self):
        self._ranges = {}  # begin address -> end address (bytes), for every live allocation
        self._finalizers = {}

    def pin(self, tensor, make_copy=True, match_shape=True):
        shape = tuple(tensor.shape) if match_shape else (tensor.numel(), )
        out = self._allocate(tensor.dtype, shape)
        if make_copy:
            out.copy_(tensor.reshape(shape) if match_shape else tensor.reshape(-1))
        return out

    def pin_empty(self, example, shape):
        return self._allocate(example.dtype, tuple(shape))

    def _allocate(self, dtype, shape):
        numel = 1
        for size in shape:
            numel *= int(size)
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = max(numel * itemsize, 1)
        region = mmap.mmap(-1, nbytes)  # page-aligned, anonymous, zero-filled
        raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps ``region`` alive as long as any view of it
        begin = raw.data_ptr()
        if _lib().mlock(ctypes.c_void_p(begin), ctypes.c_size_t(nbytes)) != 0:
            errno = ctypes.get_errno()
            raise RuntimeError(f"NativePinnedMemory: mlock of {nbytes} bytes failed ({os.strerror(errno)}); the "
                               "locked-memory limit (ulimit -l) must cover the pinned buffers, or leave "
                               "DS_PIN_MEMORY_BACKEND unset to pin through torch")
        registered = False
        try:
            registered = _cuda_register(begin, nbytes)
        except BaseException:
            _lib().munlock(ctypes.c_void_p(begin), ctypes.c_size_t(nbytes))
            raise
        self._ranges[begin] = begin + nbytes
        self._finalizers[begin] = weakref.finalize(region, _release, begin, nbytes, registered, self._ranges,
                                                   self._finalizers)
        out = raw[:numel * itemsize].view(dtype).view(shape)
        out.ds_pinned = True
        out._ds_pin_begin = begin  # unpin finds the allocation even after .data was rebound
        return out

    @staticmethod
    def _address(tensor):
        """The tensor's data address, or None for a tensor without real storage (meta, fake)."""
        if tensor.device.type == "meta" or _is_fake(tensor):
            return None
        try:
            if tensor.untyped_storage().nbytes() == 0 and tensor.numel() != 0:
                return None
            return tensor.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            return None

    def _containing(self, address):
        for begin, end in self._ranges.items():
            if begin <= address < end:
                return begin
        return None

    def is_pinned(self, tensor):
        if tensor.numel() == 0:  # no data to lie anywhere: pinned if it is an allocation of this manager
            return getattr(tensor, "_ds_pin_begin", None) in self._ranges
        address = self._address(tensor)
        return address is not None and self._containing(address) is not None

    def unpin(self, tensor):
        begin = getattr(tensor, "_ds_pin_begin", None)
        if begin not in self._ranges:
            address = self._address(tensor)
            begin = None if address is None else self._containing(address)
        if begin is None:
            return False
        finalizer = self._finalizers.get(begin)
        if finalizer is not None:
            finalizer()  # runs _release once (and never again at collection)
        return True


def _is_fake(tensor):
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover - every torch this package supports has it
        return False
    return isinstance(tensor, FakeTensor)


def get_native_pinned_memory():
    """The process-wide :class:`NativePinnedMemory`."""
    global _shared_native_pins
    if _shared_native_pins is None:
        _shared_native_pins = NativePinnedMemory()
    return _shared_native_pins


def get_active_native_pinned_memory():
    """The native manager when ``DS_PIN_MEMORY_BACKEND=native``, else None (pin through torch)."""
    if os.environ.get("DS_PIN_MEMORY_BACKEND", "torch").strip().lower() != "native":
        return None
    return get_native_pinned_memory()
