# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``PipelinedOptimizerSwapper`` (what ``pipeline_read``/``pipeline_write`` selected there): here every
NVMe optimizer step is pipelined (pages are read ahead of the step and written behind it), so the name is the one
optimizer tier, :class:`~deepspeed.runtime.swap_tensor.optimizer_swap.OptimizerStateSwap`. ``OptimizerSwapOp`` is
upstream's record of one batch of reads or writes: ``wait()`` completes them on its aio handle.
"""

from deepspeed.runtime.swap_tensor.optimizer_swap import OptimizerStateSwap

PipelinedOptimizerSwapper = OptimizerStateSwap


class OptimizerSwapOp:
    """``num_ops`` requests of ``aio_handle`` (reads when ``read_op``) for ``param_info``'s parameter."""

    def __init__(self, aio_handle, read_op, param_info, allocated_buffers, state_buffers, num_ops):
        self.aio_handle = aio_handle
        self.read_op = read_op
        self.param_info = param_info
        self.allocated_buffers = allocated_buffers
        self.state_buffers = state_buffers
        self.num_ops = num_ops
        self.wait_required = True

    def is_parameter(self, parameter):
        return getattr(self.param_info, "param_id", None) == id(parameter)

    def wait(self):
        """Complete the requests; RuntimeError if another count completed."""
        if not self.wait_required:
            return
        completed = self.aio_handle.wait()
        self.wait_required = False
        if completed != self.num_ops:
            raise RuntimeError(f"OptimizerSwapOp: {completed} of {self.num_ops} requests completed")
