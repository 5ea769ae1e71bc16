# SPDX-License-Identifier: Apache-2.0
"""``DeepSpeedCPUAdagrad``: Adagrad for host parameters (``optimizer.type: "Adagrad"`` with optimizer offload).

Upstream's constructor and state layout (``step`` and ``exp_avg_sq`` per parameter). For each parameter ``p``
with gradient ``g`` and sum of squares ``s``::

    g <- g + weight_decay * p        (L2, when weight_decay is not 0)
    s <- s + g * g
    p <- p - lr * g / (sqrt(s) + eps)

which is ``torch.optim.Adagrad`` with its defaults for ``lr_decay`` and ``initial_accumulator_value`` (0).
Sparse gradients (an ``nn.Embedding(sparse=True)``) update only their rows (``weight_decay`` must then be 0,
as in torch). ``fp32_optimizer_states=True`` (default) keeps a float16/bfloat16 parameter's sum in float32
and steps it through float32 (:mod:`deepspeed.ops.elementwise`). ``amsgrad`` is upstream's constructor
argument; Adagrad has no such variant, and ``True`` raises. Stepping a parameter that is not on the host
fails an assertion, as upstream's.
"""

import torch

from deepspeed.ops.elementwise import ElementwiseOptimizer


class DeepSpeedCPUAdagrad(ElementwiseOptimizer):
    """Adagrad on host parameters (see the module docstring)."""

    STATE_KEYS = ('exp_avg_sq', )
    HOST_ONLY = True

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False, fp32_optimizer_states=True):
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f'Adagrad: lr, eps and weight_decay must not be negative (got {lr}, {eps}, '
                             f'{weight_decay})')
        if amsgrad:
            raise NotImplementedError('DeepSpeedCPUAdagrad: amsgrad=True has no meaning for Adagrad and is not '
                                      'implemented')
        super().__init__(model_params,
                         dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad),
                         fp32_optimizer_states=fp32_optimizer_states)

    def update(self, group, params, grads, state_lists):
        sums = state_lists[0]
        if group['weight_decay'] != 0:
            grads = torch._foreach_add(grads, params, alpha=group['weight_decay'])
        torch._foreach_addcmul_(sums, grads, grads)
        denominators = torch._foreach_sqrt(sums)
        torch._foreach_add_(denominators, group['eps'])
        torch._foreach_addcdiv_(params, grads, denominators, value=-group['lr'])

    def sparse_update(self, group, param, grad, state):
        if group['weight_decay'] != 0:
            raise RuntimeError('DeepSpeedCPUAdagrad: weight_decay must be 0 for a parameter with sparse gradients')
        grad = grad.coalesce()
        sums = state['exp_avg_sq']
        work = param.detach().float() if sums.dtype != param.dtype else param.detach()
        values = grad._values().to(sums.dtype)
        sums.add_(_rows_like(grad, values * values))
        denominators = sums.sparse_mask(grad.to(sums.dtype))._values().sqrt_().add_(group['eps'])
        work.add_(_rows_like(grad, values / denominators), alpha=-group['lr'])
        if work is not param:
            param.copy_(work)


def _rows_like(grad, values):
    """A sparse tensor with the coalesced ``grad``'s indices and ``values``."""
    return torch.sparse_coo_tensor(grad._indices(), values, grad.shape, is_coalesced=True, check_invariants=False)
