# SPDX-License-Identifier: Apache-2.0
"""The ``cpu_adagrad`` op in torch, under upstream's function names and signatures.

``create_adagrad(optimizer_id, lr, eps, weight_decay, should_log)`` /
``adagrad_update(optimizer_id, step, lr, eps, weight_decay, param, grad, exp_avg_sq)`` /
``destroy_adagrad(optimizer_id)``: one dense Adagrad update in place (the maths of
:class:`~deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`, through float32 for 16-bit tensors).
"""

import torch

_created = set()


def create_adagrad(optimizer_id, lr, eps, weight_decay, should_log=False):
    _created.add(optimizer_id)
    return 0


@torch.no_grad()
def adagrad_update(optimizer_id, step, lr, eps, weight_decay, param, grad, exp_avg_sq):
    if optimizer_id not in _created:
        raise RuntimeError(f'cpu_adagrad: optimizer {optimizer_id} was not created (create_adagrad)')
    work = param.float()
    grad = grad.float()
    if weight_decay != 0:
        grad = grad + weight_decay * work
    sums = exp_avg_sq.float()
    sums.addcmul_(grad, grad)
    work.addcdiv_(grad, sums.sqrt().add_(eps), value=-lr)
    param.copy_(work)
    exp_avg_sq.copy_(sums)
    return 0


def destroy_adagrad(optimizer_id):
    _created.discard(optimizer_id)
    return 0
