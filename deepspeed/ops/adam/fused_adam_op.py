# SPDX-License-Identifier: Apache-2.0
"""The ``fused_adam`` op in torch: ``multi_tensor_adam``, with upstream's (Apex's) signature.

``multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode,
bias_correction, weight_decay)`` updates in place, for each ``i``, ``tensor_lists = [grads, params, exp_avgs,
exp_avg_sqs]``: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``, then ``p -= lr * (m / c1) /
(sqrt(v / c2) + eps)`` with ``c1 = 1 - b1^step``, ``c2 = 1 - b2^step`` (both 1 without ``bias_correction``).
``mode`` 0 adds ``weight_decay * p`` to the gradient first (L2, Adam); ``mode`` 1 decays the weight
(``p -= lr * weight_decay * p``, AdamW, from the value before the update). A nonzero ``noop_flag`` skips the
update. Moments and arithmetic are in the moments' dtype; 16-bit parameters are updated through fp32.
``chunk_size`` is accepted for the interface (torch's foreach kernels do their own chunking).
"""

import torch

ADAM_MODE_L2 = 0
ADAM_MODE_DECOUPLED = 1


@torch.no_grad()
def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction,
                      weight_decay):
    """See the module docstring."""
    if noop_flag is not None and bool(noop_flag.reshape(-1)[0]):
        return
    grads, params, exp_avgs, exp_avg_sqs = tensor_lists
    if not params:
        return
    c1 = 1 - beta1**step if bias_correction else 1.0
    c2 = 1 - beta2**step if bias_correction else 1.0
    for g, p, m, v in zip(grads, params, exp_avgs, exp_avg_sqs):
        work = p.float() if p.dtype != m.dtype else p
        grad = g.to(m.dtype)
        if mode == ADAM_MODE_L2 and weight_decay != 0:
            grad = grad + weight_decay * work
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        update = (m / c1) / ((v / c2).sqrt() + epsilon)
        if mode == ADAM_MODE_DECOUPLED and weight_decay != 0:
            update = update + weight_decay * work
        work = work - lr * update
        p.copy_(work)
