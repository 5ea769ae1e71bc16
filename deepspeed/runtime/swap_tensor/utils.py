# SPDX-License-Identifier: Apache-2.0
"""Swap-buffer helpers under upstream's names, on this package's aio handle (``deepspeed.ops.aio``).

* ``swap_in_tensors(handle, buffers, paths)`` / ``swap_out_tensors(handle, buffers, paths)``: one asynchronous read or
  write per tensor, each from or to the start of its file; the caller's ``handle.wait()`` completes them (a failed
  request raises ``AsyncIOError`` there, and a refused submission at once);
* :class:`SwapBuffer`: tensors laid out one after another in one flat (aligned) buffer, each with its swap path: the
  *swap tensor* takes ``aligned_numel`` elements (what is read or written), the *compute tensor* is its first
  ``numel``;
* :class:`SwapBufferPool`: several such buffers filled in turn, swapped in or out together;
* :class:`SwapBufferManager`: ``count`` page-locked, aligned, zeroed buffers of ``num_elems`` elements handed out and
  taken back;
* ``get_sized_buffer(s)``: the first ``num_elems`` elements of a buffer (views);
* ``MIN_AIO_BYTES`` (tensors smaller than 1 MiB are not worth a swap), ``AIO_ALIGNED_BYTES`` (upstream's numel
  alignment, 1024 bytes; the aio handle itself needs 4096 for ``O_DIRECT`` and takes any other through the page cache).

NVMe offload itself (``optimizer_swap.py``, ``param_swap.py``) pages through ``paged_store.py`` and uses none of
these; they are here for code written against upstream's swap helpers.
"""

import torch

from deepspeed.utils.logging import logger

MIN_AIO_BYTES = 1024**2
AIO_ALIGNED_BYTES = 1024
MIN_SWAPPABLE_BYTES = MIN_AIO_BYTES


def swap_in_tensors(swap_handle, tensor_buffers, swap_paths):
    """Start reading each of ``tensor_buffers`` from the start of its path in ``swap_paths``."""
    for buffer, path in zip(tensor_buffers, swap_paths):
        swap_handle.async_pread(buffer, path, 0)


def swap_out_tensors(swap_handle, tensor_buffers, swap_paths):
    """Start writing each of ``tensor_buffers`` to the start of its path in ``swap_paths``."""
    for buffer, path in zip(tensor_buffers, swap_paths):
        swap_handle.async_pwrite(buffer, path, 0)


def print_object(obj, name, exclude_list=()):
    """Log ``obj``'s attributes, one a line (upstream's debugging helper)."""
    logger.info(f"{name}:")
    for key in sorted(vars(obj)):
        if key not in exclude_list:
            logger.info(f"  {key} {'.' * max(1, 29 - len(key))} {getattr(obj, key)}")


class SwapBuffer:
    """Tensors placed one after another in the flat tensor ``buffer`` (see the module docstring)."""

    def __init__(self, buffer):
        self.buffer = buffer
        self.reset()

    def reset(self):
        """Forget every tensor placed; the whole buffer is free again."""
        self.offset = 0
        self.num_elem = 0
        self.swap_tensors = {}
        self.compute_tensors = {}
        self.swap_paths = {}

    def has_space(self, numel):
        return self.offset + int(numel) <= self.buffer.numel()

    def allocate_tensor(self, swap_path, numel, aligned_numel):
        """Place a tensor of ``numel`` elements (``aligned_numel`` reserved) for ``swap_path``; returns
        ``(swap_tensor, compute_tensor)``. ValueError when the buffer is full."""
        if aligned_numel < numel or not self.has_space(aligned_numel):
            raise ValueError(f"SwapBuffer: no room for {aligned_numel} elements at {self.offset} of "
                             f"{self.buffer.numel()}")
        at = self.offset
        swap_tensor = self.buffer.narrow(0, at, aligned_numel)
        self.swap_tensors[at] = swap_tensor
        self.compute_tensors[at] = swap_tensor.narrow(0, 0, numel)
        self.swap_paths[at] = swap_path
        self.offset += int(aligned_numel)
        self.num_elem += int(numel)
        return swap_tensor, self.compute_tensors[at]

    def insert_tensor(self, tensor, swap_path, aligned_numel):
        """:meth:`allocate_tensor` for ``tensor``'s size, and copy ``tensor`` into the compute tensor."""
        swap_tensor, compute_tensor = self.allocate_tensor(swap_path, tensor.numel(), aligned_numel)
        compute_tensor.copy_(tensor.detach().reshape(-1))
        return swap_tensor, compute_tensor

    def get_swap_tensors(self):
        return list(self.swap_tensors.values())

    def get_swap_paths(self):
        return list(self.swap_paths.values())

    def get_compute_tensors(self):
        return list(self.compute_tensors.values())

    def get_num_elem(self):
        return self.num_elem

    def get_swap_tensor(self, offset):
        return self.swap_tensors.get(offset)

    def get_compute_tensor(self, offset):
        return self.compute_tensors.get(offset)

    def get_swap_path(self, offset):
        return self.swap_paths.get(offset)


class SwapBufferPool:
    """:class:`SwapBuffer` over each of ``buffers`` (aligned for the aio handle), filled one after another."""

    def __init__(self, buffers, aio_handle=None):
        if aio_handle is not None:
            unaligned = [i for i, b in enumerate(buffers) if not aio_handle.is_pinned(b)]
            if unaligned:
                raise ValueError(f"SwapBufferPool: buffers {unaligned} are not usable by the aio handle directly; "
                                 "allocate them with aio_handle.new_cpu_locked_tensor")
        self.buffers = [SwapBuffer(b) for b in buffers]
        self.current_index = 0

    def reset(self):
        self.current_index = 0
        for buffer in self.buffers:
            buffer.reset()

    def _current(self):
        return self.buffers[self.current_index]

    def _used(self):
        return self.buffers[:self.current_index + 1]

    def has_space(self, numel):
        """Whether ``numel`` elements fit in the current buffer or, moving on to it, the next one."""
        if not self.buffers:
            return False
        if self._current().has_space(numel):
            return True
        if self.current_index + 1 >= len(self.buffers):
            return False
        self.current_index += 1
        return self._current().has_space(numel)

    def allocate_tensor(self, numel, swap_path, aligned_numel):
        """``(swap_tensor, compute_tensor)``, or ``(None, None)`` when the pool is full."""
        if not self.has_space(aligned_numel):
            return None, None
        return self._current().allocate_tensor(swap_path, numel, aligned_numel)

    def insert_tensor(self, tensor, swap_path, aligned_numel):
        """``(swap_tensor, compute_tensor)`` holding a copy of ``tensor``, or ``(None, None)`` when full."""
        if not self.has_space(aligned_numel):
            return None, None
        return self._current().insert_tensor(tensor, swap_path, aligned_numel)

    def get_swap_tensors(self):
        return [t for buffer in self._used() for t in buffer.get_swap_tensors()]

    def get_swap_paths(self):
        return [p for buffer in self._used() for p in buffer.get_swap_paths()]

    def get_compute_tensors(self):
        return [t for buffer in self._used() for t in buffer.get_compute_tensors()]

    def _swap(self, aio_handle, write, async_op):
        tensors, paths = self.get_swap_tensors(), self.get_swap_paths()
        if any(p is None for p in paths):
            raise ValueError("SwapBufferPool: a tensor has no swap path")
        (swap_out_tensors if write else swap_in_tensors)(aio_handle, tensors, paths)
        if not async_op:
            completed = aio_handle.wait()
            if completed != len(tensors):
                raise RuntimeError(f"SwapBufferPool: {completed} of {len(tensors)} requests completed")

    def swap_out(self, aio_handle, async_op=False):
        """Write every placed tensor to its path (``wait()`` completes it when ``async_op``)."""
        self._swap(aio_handle, True, async_op)

    def swap_in(self, aio_handle, async_op=False):
        """Read every placed tensor from its path (``wait()`` completes it when ``async_op``)."""
        self._swap(aio_handle, False, async_op)


class SwapBufferManager:
    """``count`` aligned, page-locked, zeroed buffers of ``num_elems`` elements of ``dtype``, lent and returned."""

    def __init__(self, num_elems, count, dtype, aio_handle=None):
        from deepspeed.ops.aio.buffers import aligned_empty
        self.num_elems = int(num_elems)
        self.count = int(count)
        self.dtype = dtype
        self.aio_handle = aio_handle
        self.all_buffers = [aligned_empty(self.num_elems, dtype).zero_() for _ in range(self.count)]
        self.free_buffer_index = list(range(self.count))
        self.used_buffer_index = {}
        self.gigabytes = self.num_elems * self.count * torch.empty((), dtype=dtype).element_size() / 1024**3

    def allocate(self, num_elems, count, dtype):
        """``count`` buffers cut to ``num_elems`` elements, or None when fewer are free."""
        if dtype != self.dtype:
            raise ValueError(f"SwapBufferManager: buffers of {self.dtype}, asked for {dtype}")
        if num_elems > self.num_elems:
            raise ValueError(f"SwapBufferManager: buffers of {self.num_elems} elements, asked for {num_elems}")
        if count > len(self.free_buffer_index):
            return None
        taken, self.free_buffer_index = self.free_buffer_index[-count:], self.free_buffer_index[:-count]
        buffers = []
        for index in taken:
            view = self.all_buffers[index].narrow(0, 0, num_elems)
            self.used_buffer_index[id(view)] = index
            buffers.append(view)
        return buffers

    def allocate_all(self, num_elems, dtype):
        return self.allocate(num_elems, len(self.free_buffer_index), dtype)

    def free(self, buffers):
        """Take back buffers of :meth:`allocate` (the same view objects)."""
        indexes = []
        for buffer in buffers:
            index = self.used_buffer_index.pop(id(buffer), None)
            if index is None:
                raise ValueError("SwapBufferManager: a buffer that was not lent by this manager")
            indexes.append(index)
        self.free_buffer_index += indexes


def get_sized_buffer(buffer, num_elems):
    """The first ``num_elems`` elements of ``buffer`` (a view)."""
    if num_elems > buffer.numel():
        raise ValueError(f"num_elems {num_elems} > buffer {buffer.numel()}")
    return buffer.narrow(0, 0, num_elems) if num_elems < buffer.numel() else buffer


def get_sized_buffers(buffer_list, num_elems_list):
    return [get_sized_buffer(b, n) for b, n in zip(buffer_list, num_elems_list)]
