# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``original_muon`` names, on this package's Muon (:mod:`deepspeed.ops.muon`).

``zeropower_via_newtonschulz5`` / ``zeropower_via_gram_newtonschulz`` (the ``"standard"`` and ``"gram"``
iterations), ``ns_compute_dtype``, ``muon_update`` (momentum, Nesterov blend and the scaled direction of one whole
matrix; a non-finite gradient leaves the momentum alone and comes back as the update, so an overflow is still seen),
``adam_update``; and the optimizers ``SingleDeviceMuon`` / ``Muon`` (every parameter of every group on Muon) and
``MuonWithAuxAdam`` / ``SingleDeviceMuonWithAuxAdam`` (``use_muon`` per group). Every rank computes every matrix in
``Muon`` here (upstream spreads them round-robin and all-gathers the parameters: the same result); inside an
engine the stages run the matrix step (docs/zero.md). Per-head orthogonalization (``num_heads``) is not built.
"""

import torch

from deepspeed.accelerator import get_accelerator
from deepspeed.ops.muon.muon import MuonWithAuxAdam as _MuonWithAuxAdam
from deepspeed.ops.muon.newton_schulz import NS_METHODS, aspect_scale, orthogonalize
from deepspeed.ops.muon.newton_schulz import ns_compute_dtype as _ns_compute_dtype

__all__ = [
    "ns_compute_dtype", "zeropower_via_newtonschulz5", "zeropower_via_gram_newtonschulz", "muon_update", "adam_update",
    "Muon", "SingleDeviceMuon", "MuonWithAuxAdam", "SingleDeviceMuonWithAuxAdam", "NS_METHODS"
]


def ns_compute_dtype(ns_method="gram"):
    """The dtype the iteration of ``ns_method`` runs in on the current accelerator."""
    return _ns_compute_dtype(ns_method, get_accelerator().current_device_name())


def zeropower_via_newtonschulz5(G, steps):
    return orthogonalize(G, steps, "standard")


def zeropower_via_gram_newtonschulz(G, steps):
    return orthogonalize(G, steps, "gram")


@torch.no_grad()
def muon_update(grad,
                momentum,
                beta=0.95,
                ns_steps=5,
                nesterov=True,
                ns_method="gram",
                is_expert_group=False,
                num_heads=None):
    """Muon's update of one parameter from its gradient; ``momentum`` is updated in place. A parameter with more than
    two dimensions is one matrix ``view(shape[0], -1)``, or a batch of matrices with ``is_expert_group``."""
    if num_heads is not None:
        raise NotImplementedError("per-head Muon (num_heads) is not supported by this DeepSpeed runtime; see "
                                  "docs/compatibility.md")
    finite = torch.isfinite(grad).all()
    momentum.copy_(torch.where(finite, momentum.lerp(grad, 1 - beta), momentum))
    update = grad.lerp(momentum, beta) if nesterov else momentum.clone()
    if is_expert_group:
        direction = orthogonalize(update, ns_steps, ns_method).float() * aspect_scale(*update.shape[-2:])
    else:
        matrix = update.reshape(update.shape[0], -1)
        direction = (orthogonalize(matrix, ns_steps, ns_method).float() * aspect_scale(*matrix.shape)).view(
            update.shape)
    return torch.where(finite, direction.to(grad.dtype), grad)


def adam_update(grad, buf1, buf2, step, betas, eps):
    """The bias-corrected Adam direction; ``buf1``/``buf2`` (first and second moments) are updated in place."""
    buf1.lerp_(grad, 1 - betas[0])
    buf2.lerp_(grad.square(), 1 - betas[1])
    return (buf1 / (1 - betas[0]**step)) / ((buf2 / (1 - betas[1]**step)).sqrt() + eps)


class SingleDeviceMuon(_MuonWithAuxAdam):
    """Muon on every parameter (``lr`` 0.02, ``weight_decay`` 0, ``momentum`` 0.95, ``ns_method`` gram)."""

    def __init__(self, params, lr=0.02, weight_decay=0, momentum=0.95, ns_method="gram"):
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_method=ns_method)
        super().__init__([{**defaults, **g, "use_muon": True} for g in groups])


Muon = SingleDeviceMuon


class MuonWithAuxAdam(_MuonWithAuxAdam):
    """Muon on the ``use_muon`` groups, AdamW (upstream's inline Adam maths: torch's AdamW) on the others."""

    def __init__(self, param_groups):
        super().__init__(param_groups)


SingleDeviceMuonWithAuxAdam = MuonWithAuxAdam
