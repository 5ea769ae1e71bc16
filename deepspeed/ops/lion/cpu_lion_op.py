# SPDX-License-Identifier: Apache-2.0
"""The ``cpu_lion`` op in torch, with upstream's functions: ``create_lion(optimizer_id, lr, beta1, beta2,
weight_decay, should_log)``, ``lion_update(optimizer_id, step, lr, beta1, beta2, weight_decay, param, grad,
exp_avg)`` (one tensor, in place: :func:`deepspeed.ops.lion.functional.lion_through_fp32_`) and
``destroy_lion(optimizer_id)``."""

from deepspeed.ops.lion.functional import lion_through_fp32_

_created = set()


def create_lion(optimizer_id, lr, beta1, beta2, weight_decay, should_log=False):
    _created.add(optimizer_id)
    return 0


def lion_update(optimizer_id, step, lr, beta1, beta2, weight_decay, param, grad, exp_avg):
    if optimizer_id not in _created:
        raise RuntimeError(f'cpu_lion: optimizer {optimizer_id} was not created (create_lion)')
    lion_through_fp32_([param], [grad], [exp_avg], lr, beta1, beta2, weight_decay)
    return 0


def destroy_lion(optimizer_id):
    _created.discard(optimizer_id)
    return 0
