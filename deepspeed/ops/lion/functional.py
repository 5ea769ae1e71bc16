# SPDX-License-Identifier: Apache-2.0
"""The Lion update (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023), on torch's foreach kernels.

For each parameter ``p`` with gradient ``g`` and momentum ``m``::

    p <- p * (1 - lr * weight_decay) - lr * sign(beta1 * m + (1 - beta1) * g)
    m <- beta2 * m + (1 - beta2) * g

Weight decay is decoupled (applied to the weight, not added to the gradient). ``sign(0)`` is 0.
"""

import torch

from deepspeed.ops.elementwise import LOW_PRECISION


@torch.no_grad()
def lion_(params, grads, exp_avgs, lr, beta1, beta2, weight_decay):
    """The update above, in place, over lists of same-dtype tensors."""
    if not params:
        return
    direction = torch._foreach_mul(exp_avgs, beta1)
    torch._foreach_add_(direction, grads, alpha=1 - beta1)
    torch._foreach_sign_(direction)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_add_(params, direction, alpha=-lr)
    torch._foreach_mul_(exp_avgs, beta2)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - beta2)


@torch.no_grad()
def lion_through_fp32_(params, grads, exp_avgs, lr, beta1, beta2, weight_decay):
    """:func:`lion_`, computed in float32 when a parameter or momentum is 16-bit (each rounded back once)."""
    if all(p.dtype not in LOW_PRECISION and m.dtype == p.dtype for p, m in zip(params, exp_avgs)):
        lion_(params, [g.to(p.dtype) for g, p in zip(grads, params)], exp_avgs, lr, beta1, beta2, weight_decay)
        return
    work, moments = [p.float() for p in params], [m.float() for m in exp_avgs]
    lion_(work, [g.float() for g in grads], moments, lr, beta1, beta2, weight_decay)
    for p, w, m, w_m in zip(params, work, exp_avgs, moments):
        p.copy_(w)
        m.copy_(w_m)
