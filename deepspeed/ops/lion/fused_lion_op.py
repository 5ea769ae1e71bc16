# SPDX-License-Identifier: Apache-2.0
"""The ``fused_lion`` op in torch, with upstream's signature.

``multi_tensor_lion(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, step, weight_decay)`` updates
``tensor_lists = [grads, params, exp_avgs]`` in place (:func:`deepspeed.ops.lion.functional.lion_through_fp32_`).
A nonzero ``noop_flag`` skips the update; ``chunk_size`` and ``step`` are accepted for the interface (Lion has no
bias correction; torch's foreach kernels do their own chunking).
"""

from deepspeed.ops.lion.functional import lion_through_fp32_


def multi_tensor_lion(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, step, weight_decay):
    if noop_flag is not None and bool(noop_flag.reshape(-1)[0]):
        return
    grads, params, exp_avgs = tensor_lists
    if params:
        lion_through_fp32_(params, grads, exp_avgs, lr, beta1, beta2, weight_decay)
