# SPDX-License-Identifier: Apache-2.0
"""``AsyncTensorSwapper`` (upstream's name): writes many tensors to their files through a few aligned buffers.

``add_buffers(buffers)`` lends it aligned buffers (``aio_handle.new_cpu_locked_tensor``); ``swap_out_tensors(tensors,
paths)`` copies each tensor into the current buffer (at a multiple of ``numel_alignment`` elements) and writes a full
buffer asynchronously while the next one fills; ``release_buffers()`` writes what is left, waits for every write
(a failed one raises ``AsyncIOError``) and returns the buffers. A tensor larger than a buffer raises ValueError.
"""

from deepspeed.runtime.swap_tensor.utils import SwapBuffer, swap_out_tensors


class AsyncTensorSwapper:
    """See the module docstring; ``timers`` (upstream's timer registry, or None) is accepted and not used."""

    def __init__(self, aio_handle, numel_alignment, timers=None):
        self.aio_handle = aio_handle
        self.numel_alignment = max(1, int(numel_alignment))
        self.timers = timers
        self.free_buffers = []
        self.swapping_buffers = []  # written, not waited for yet
        self.current = None
        self.num_elements_swapped = 0

    def has_buffers(self):
        return bool(self.free_buffers or self.swapping_buffers or self.current is not None)

    def add_buffers(self, buffer_list):
        if self.has_buffers():
            raise ValueError("AsyncTensorSwapper: release the buffers before adding new ones")
        if not all(self.aio_handle.is_pinned(b) for b in buffer_list):
            raise ValueError("AsyncTensorSwapper: buffers must come from aio_handle.new_cpu_locked_tensor")
        self.free_buffers = [SwapBuffer(b) for b in buffer_list]

    def get_timer_names(self):
        return []

    def _aligned(self, numel):
        return -(-int(numel) // self.numel_alignment) * self.numel_alignment

    def _write_current(self):
        if self.current is not None and self.current.get_num_elem():
            swap_out_tensors(self.aio_handle, self.current.get_swap_tensors(), self.current.get_swap_paths())
            self.num_elements_swapped += self.current.get_num_elem()
            self.swapping_buffers.append(self.current)
        elif self.current is not None:
            self.free_buffers.append(self.current)
        self.current = None

    def _wait(self):
        self.aio_handle.wait()
        for buffer in self.swapping_buffers:
            buffer.reset()
        self.free_buffers += self.swapping_buffers
        self.swapping_buffers = []

    def _buffer_for(self, aligned):
        if self.current is not None and self.current.has_space(aligned):
            return self.current
        self._write_current()
        if not self.free_buffers:
            self._wait()
        self.current = self.free_buffers.pop(0)
        if not self.current.has_space(aligned):
            raise ValueError(f"AsyncTensorSwapper: a tensor of {aligned} elements does not fit a buffer of "
                             f"{self.current.buffer.numel()}")
        return self.current

    def swap_out_tensors(self, tensor_list, path_list):
        for tensor, path in zip(tensor_list, path_list):
            aligned = self._aligned(tensor.numel())
            self._buffer_for(aligned).insert_tensor(tensor, path, aligned)

    def release_buffers(self):
        """Write what is left, wait for every write, and return the buffers lent by :meth:`add_buffers`."""
        self._write_current()
        self._wait()
        buffers = [b.buffer for b in self.free_buffers]
        self.free_buffers = []
        return buffers
