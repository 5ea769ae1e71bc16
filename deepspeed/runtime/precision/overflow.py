# SPDX-License-Identifier: Apache-2.0
"""What a skipped boundary step tells the user.

A boundary step whose global gradient norm is not finite is skipped on every rank (the verdict comes
from reduced gradients, so every rank reaches it): the weights, the optimizer state and the LR schedule
stay as they were, ``engine.was_step_applied()`` is False and ``engine.skipped_steps`` grows by one;
``global_steps`` and ``global_samples`` still advance, as upstream counts them.

Which engines check: fp16 always (an overflow is how its dynamic loss scale learns); bf16 when
``bf16.check_grad_overflow`` is true (the default); fp32 only when the user sets
``engine.optimizer.check_grad_overflow = True``, as upstream.

For fp16 an overflow is routine while the loss scale settles, so it is logged at info level; for bf16
and fp32 it means a NaN or an infinity reached the gradients, so it is a warning.
"""

import logging

from deepspeed.utils.logging import log_dist


def report_skipped_step(step, loss_scaler, grad_norm):
    """Log, on rank 0, that boundary step ``step`` (1-based) was skipped, and why.

    ``loss_scaler`` is the engine's scaler (dynamic for fp16), ``grad_norm`` the global gradient norm
    that was not finite (a float, or None when unknown).
    """
    norm = "" if grad_norm is None else f" (global gradient norm {grad_norm})"
    if getattr(loss_scaler, "dynamic", False):
        log_dist(
            f"step {step}: fp16 gradient overflow{norm}; the optimizer step is skipped and the loss scale is "
            f"now {loss_scaler.loss_scale}",
            ranks=[0])
        return
    log_dist(
        f"step {step}: non-finite gradient{norm}; the optimizer step is skipped on every rank (weights, "
        f"optimizer state and LR schedule unchanged). A NaN or an infinity reached the gradients: check the "
        f"loss and the data of this step.",
        ranks=[0],
        level=logging.WARNING)
