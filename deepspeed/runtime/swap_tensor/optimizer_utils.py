# SPDX-License-Identifier: Apache-2.0
"""Upstream's optimizer-swapping records, and ``OptimizerSwapper``, the base upstream's two optimizer swappers share:
here the one optimizer tier, :class:`~deepspeed.runtime.swap_tensor.optimizer_swap.OptimizerStateSwap`.

``FlattenedTensorSwapInfo`` (where a piece of a flat tensor lives in a file), ``SwapTensorContext`` (a tensor, its
swap path and buffers) and ``OptimizerStateSwapInfo`` (a parameter's swapped state tensors and their paths) are the
small records upstream's helpers pass around, kept for code that builds them.
"""

import os

from deepspeed.runtime.swap_tensor.optimizer_swap import OptimizerStateSwap

OptimizerSwapper = OptimizerStateSwap


class FlattenedTensorSwapInfo:
    """``length`` elements at element ``offset`` of the file ``path``."""

    def __init__(self, path, length, offset):
        self.path = path
        self.offset = offset
        self.length = length


class SwapTensorContext:
    """``tensor`` and its swap file in ``swap_folder`` (named after the tensor's id), with its buffers once set."""

    def __init__(self, tensor, swap_folder):
        self.compute_tensor = tensor
        self.swap_buffer = None
        self.swap_path = os.path.join(swap_folder, f"{id(tensor)}.tensor.swp")

    def release_memory(self):
        self.compute_tensor.data = self.compute_tensor.data.new_empty(0)
        self.swap_buffer = None

    def set_buffers(self, compute_buffer, swap_buffer):
        self.compute_tensor.data = compute_buffer.data
        self.swap_buffer = swap_buffer


class OptimizerStateSwapInfo:
    """The state tensors of ``parameter`` (``numel`` elements each) swapped into ``base_folder``."""

    def __init__(self, parameter, numel, base_folder, aio_handle=None):
        self.tensors = []
        self.param_id = id(parameter)
        self.swap_folder = base_folder
        self.swapped_gradients = {}
        self.unswapped_gradients = {}
        self.tensor_numel = numel
        self.tensor_dtype = parameter.dtype
        self.tensor_device = parameter.device
        self.has_state_tensors = False
        self.swap_buffers = []
        self._add_tensors([parameter])

    def numel(self):
        return self.tensor_numel

    def has_gradients(self):
        return bool(self.swapped_gradients or self.unswapped_gradients)

    def _add_tensors(self, tensor_list):
        for tensor in tensor_list:
            self.tensors.append(SwapTensorContext(tensor, self.swap_folder))

    def add_state_tensors(self, tensor_list):
        self.has_state_tensors = True
        self._add_tensors(tensor_list)

    def num_tensors(self):
        return len(self.tensors)

    def device(self):
        return self.tensor_device

    def dtype(self):
        return self.tensor_dtype

    def release_memory(self):
        for context in self.tensors:
            context.release_memory()

    def get_compute_tensors(self):
        return [context.compute_tensor for context in self.tensors]

    def get_swap_paths(self):
        return [context.swap_path for context in self.tensors]

    def set_swap_buffers(self, buffers, aligned_numel):
        """Point every state tensor at its buffer (the first ``numel`` of ``aligned_numel`` elements)."""
        self.swap_buffers = list(buffers)
        for context, buffer in zip(self.tensors, buffers):
            context.set_buffers(buffer.narrow(0, 0, self.tensor_numel), buffer.narrow(0, 0, aligned_numel))
