# SPDX-License-Identifier: Apache-2.0
"""``MultiTensorApply``: call a multi-tensor op over lists of tensors (upstream's helper, Apex's interface)."""


class MultiTensorApply:
    """``MultiTensorApply(chunk_size)(op, noop_flag_buffer, tensor_lists, *args)`` calls
    ``op(chunk_size, noop_flag_buffer, tensor_lists, *args)``."""

    available = True
    warned = False

    def __init__(self, chunk_size):
        self.chunk_size = chunk_size

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)
