# SPDX-License-Identifier: Apache-2.0
"""Modules recomputed in backward from their input alone (an ALST memory tool beyond the tiled MLP and loss).

A decoder layer's normalisations keep most of what its recomputation stores per token: HF's RMSNorm keeps its
input cast to float32 (twice the bytes of a bf16 hidden state) and the normalised bf16 value, for two norms per
layer, about 24 KB per token of a 2048-wide bf16 model against about 22 KB for everything else the layer keeps
once its MLP is tiled. :func:`enable_recompute_in_backward` makes chosen modules keep only their input (which the
next module usually keeps anyway) and rerun their forward in backward: the same operations on the same values.
Outputs are bit for bit the module's; so are the gradients where the module reads its input once (a bf16 norm
reads it through its float32 cast). A float32 norm reads its input twice, and autograd then sums those two
gradients and the residual's in another order than here: equal up to that rounding.
"""

from typing import Callable, Optional

import torch

from deepspeed.runtime.sequence_parallel.tiled_compute import AutogradComputeMLP

__all__ = ["enable_recompute_in_backward", "is_norm"]


def is_norm(module: torch.nn.Module) -> bool:
    """The default choice: RMSNorm-like modules (by class name) and ``torch.nn.LayerNorm``."""
    return "RMSNorm" in type(module).__name__ or isinstance(module, torch.nn.LayerNorm)


def enable_recompute_in_backward(model: torch.nn.Module,
                                 predicate: Optional[Callable[[torch.nn.Module], bool]] = None) -> int:
    """Recompute every submodule of ``model`` for which ``predicate`` holds (default :func:`is_norm`) in backward.

    Each chosen module's ``forward(x)`` must take one tensor and return one tensor (norms do). Returns how many
    modules were changed. Calling it again changes nothing more.
    """
    predicate = predicate or is_norm
    count = 0
    for module in model.modules():
        if getattr(module, "_ds_recomputed", False) or not predicate(module):
            continue
        plain = module.forward

        def forward(x, _plain=plain, _module=module):
            if _module._ds_recomputing or not torch.is_grad_enabled() or not (x.requires_grad
                                                                              or any(p.requires_grad
                                                                                     for p in _module.parameters())):
                return _plain(x)
            return AutogradComputeMLP.apply(_call_plain, _module, x)

        module.forward = forward
        module._ds_recomputed = True
        module._ds_recomputing = False
        count += 1
    return count


def _call_plain(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's own forward through ``module(x)``, so its hooks run as in forward (ZeRO-3 gathers the
    parameters it released since)."""
    module._ds_recomputing = True
    try:
        return module(x)
    finally:
        module._ds_recomputing = False
