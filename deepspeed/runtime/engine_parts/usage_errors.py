# SPDX-License-Identifier: Apache-2.0
"""Errors for engine calls the configuration does not allow, with the exception types upstream code expects.

Upstream rejects these calls with ``assert``; scripts and upstream's own tests catch ``AssertionError``
(``pytest.raises(AssertionError, match=...)``), while this runtime's callers expect the natural type.
Each error here is both, and its message keeps the words upstream's tests match.
"""

import torch


class EngineUsageError(RuntimeError, AssertionError):
    """A call the engine's configuration does not allow (``no_sync`` on ZeRO 2/3, a manual accumulation
    boundary with unmanaged accumulation)."""


class LossNotScalarError(ValueError, AssertionError):
    """``engine.backward``/``engine.scale`` given a loss that is not one number."""


def require_scalar_loss(loss, api):
    """Raise :class:`LossNotScalarError` unless ``loss`` is a tensor of one element.

    ``api`` names the call in the message (``"engine.scale"``). A non-scalar output is back-propagated
    with ``output.backward(grad)``, which the engine supports as any other backward; under fp16, whose
    gradients must carry the loss scale, ``engine.scale((output * grad).sum()).backward()`` computes the
    same gradients.
    """
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return
    what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
    raise LossNotScalarError(f"{api}(loss): loss must be a scalar tensor, got {what}. For a non-scalar output, "
                             f"call output.backward(grad) directly (with fp16, which needs the loss scale: "
                             f"engine.scale((output * grad).sum()).backward(), the same gradients).")
