# SPDX-License-Identifier: Apache-2.0
"""``FusedLion``: Lion for parameters on any device (``optimizer.type: "Lion"`` without optimizer offload).

Upstream's constructor and state layout (``step`` and ``exp_avg`` per parameter, the momentum in the parameter's
dtype); the update is :func:`deepspeed.ops.lion.functional.lion_`, computed in float32 for float16/bfloat16
parameters (parameter and momentum rounded back once).
"""

from deepspeed.ops.elementwise import ElementwiseOptimizer
from deepspeed.ops.lion.functional import lion_through_fp32_


def check_lion_args(lr, betas, weight_decay):
    if lr < 0.0:
        raise ValueError(f'Lion: invalid learning rate {lr}')
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f'Lion: betas must be two values in [0, 1), got {betas}')
    if weight_decay < 0.0:
        raise ValueError(f'Lion: invalid weight_decay {weight_decay}')


class LionUpdate:
    """The Lion update of an :class:`~deepspeed.ops.elementwise.ElementwiseOptimizer`."""

    STATE_KEYS = ('exp_avg', )

    def update(self, group, params, grads, state_lists):
        beta1, beta2 = group['betas']
        lion_through_fp32_(params, grads, state_lists[0], group['lr'], beta1, beta2, group['weight_decay'])


class FusedLion(LionUpdate, ElementwiseOptimizer):
    """Lion (see :mod:`deepspeed.ops.lion.functional`); ``set_grad_none`` is upstream's ``zero_grad`` default."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0., set_grad_none=True):
        check_lion_args(lr, betas, weight_decay)
        super().__init__(params,
                         dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay),
                         fp32_optimizer_states=False)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none=None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
