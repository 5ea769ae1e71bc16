# SPDX-License-Identifier: Apache-2.0
"""What a gradient audit found: :class:`AuditReport`, and the arithmetic that turns sums into errors.

For direction ``k`` the audit has two numbers for the realized move ``d_k`` of the parameters:

* ``dF_k = F(theta + d_k / 2) - F(theta - d_k / 2)``: the change of the window's loss ``F``,
  computed by forward passes only (a central difference): the reference;
* ``gd_k = <g, d_k>``: the same change predicted by the gradient ``g`` the optimizer is about
  to use.

They agree, up to the difference's truncation and the forward's rounding, exactly when
``g`` is the derivative of ``F`` along ``d_k``. The relative error of a direction is the
discrepancy relative to the typical loss change along a move of that length:

    |gd_k - dF_k| / (|d_k| * max(rms_j(dF_j / |d_j|), |g| / (2 sqrt(N))))

``rms_j(dF_j / |d_j|)`` is the root mean square, over the audit's directions, of the loss
change per unit move (the directional derivatives the loss gives); ``|g| / sqrt(N)`` is the
typical size of ``<g, d / |d|>`` for a random direction over ``N`` elements, halved (a floor
for an audit of one direction, or a loss that does not move). The scale is the same for
every direction: the noise of the check (truncation, rounding) does not shrink when a
direction happens to be nearly orthogonal to the gradient, so dividing by that direction's
own ``|dF_k|`` would turn noise into large errors. What errors look like: a gradient twice
too large gives about ``|z_k|``, the direction's derivative relative to the typical one (a
standard normal value; the largest of four is above 0.25 with a probability of 99.8%, above
0.5 of 98%); a missing part of the gradient (a zeroed group, a detached branch) about its
share of ``|g|`` times such a value. The check is probabilistic: see docs/audit.md.

Defaults by the precision the forward computes in (the model's dtype, or tf32), chosen by the
measurements in docs/audit.md: the step is where the central difference's truncation (which
grows as the step squared) meets the forward's rounding (which grows as one over the step);
the tolerance is at least twice the largest error the true gradient showed there, and below
what a gradient twice too large gave.
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

# By the precision the forward computes in (see compute_precision): (relative step, default tolerance).
# Each element moves by about ``relative step`` times the root mean square of all the parameters.
PRECISIONS = {
    "fp32": (5e-3, 2e-2),
    "tf32": (2e-2, 0.15),  # fp32 weights, matmuls or convolutions in tf32 (10 mantissa bits, as fp16); not measured
    "fp16": (2e-2, 0.15),
    "bf16": (3e-2, 0.25),
}
_OF_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def compute_precision(model_dtype, module=None):
    """The precision the forward of an engine's model computes in: its dtype's, or for fp32 weights on CUDA with
    reduced-precision float32 matmuls (``torch.backends.cuda.matmul.allow_tf32``, or a float32 matmul precision
    below "highest"), or convolutions in a model with convolutions under ``torch.backends.cudnn.allow_tf32``,
    "tf32" (or "bf16" for the matmul precision "medium")."""
    precision = _OF_DTYPE.get(model_dtype, "fp32")
    if precision != "fp32" or not torch.cuda.is_available():
        return precision
    matmul = torch.get_float32_matmul_precision()
    if matmul == "medium":
        return "bf16"
    if matmul == "high" or torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    if torch.backends.cudnn.allow_tf32 and module is not None and any(
            isinstance(m, torch.nn.modules.conv._ConvNd) for m in module.modules()):
        return "tf32"
    return precision


def default_tolerance(precision):
    return PRECISIONS[precision][1]


def relative_step(precision):
    return PRECISIONS[precision][0]


def relative_error(gd, df, scale):
    """``|gd - df| / scale`` (see the module docstring); 0 when both are 0, inf when not finite or not scalable."""
    if not all(math.isfinite(v) for v in (gd, df, scale)):
        return math.inf
    if scale == 0.0:
        return 0.0 if gd == df else math.inf
    return abs(gd - df) / scale


def _rms(values):
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else 0.0


def error_scale(move_norm, unit_changes, typical, reference_changes=()):
    """The typical loss change for a move of length ``move_norm`` (the denominator of :func:`relative_error`).

    ``unit_changes``: the loss change per unit move of each of the audit's directions; ``typical``:
    the root mean square of ``<g, d>`` over random moves ``d`` like this one. A group's own check
    also passes the whole model's ``unit_changes`` as ``reference_changes``: a group whose loss
    moves less than the model's on average is measured against the model's, so the forward's
    rounding (the same whatever moves) does not make a small group look wrong."""
    return move_norm * max(_rms(unit_changes), _rms(reference_changes),
                           0.5 * typical / move_norm if move_norm else 0.0)


@dataclass(frozen=True)
class DirectionResult:
    """One direction: its relative error and both sides along the unit vector of the realized move."""
    index: int
    relative_error: float
    directional_derivative: float  # (F(+) - F(-)) / |d|: from forward passes of the loss
    gradient_projection: float  # <g, d> / |d|: from the gradient the optimizer is about to use


@dataclass(frozen=True)
class GroupResult:
    """One parameter group. ``relative_error`` is measured along a direction inside the group only; it is
    measured when the audit found a mismatch and there are several groups (else None)."""
    index: int
    name: str
    numel: int
    grad_norm: float
    relative_error: Optional[float] = None
    mismatch: bool = False


@dataclass(frozen=True)
class AuditReport:
    """The result of ``engine.audit_gradients``; equal on every rank (it is computed from all-reduced sums).

    ``ok``: every direction's relative error is within ``tolerance`` (or the audit was skipped,
    see ``skipped``). ``dominant_groups``: names of the groups whose own check failed, largest
    discrepancy first (empty when ``ok``).
    """
    ok: bool
    max_rel_error: float
    rel_errors: Tuple[float, ...]
    tolerance: float
    dominant_groups: Tuple[str, ...] = ()
    directions: Tuple[DirectionResult, ...] = ()
    groups: Tuple[GroupResult, ...] = ()
    precision: str = "fp32"  # what the forward computes in (see compute_precision)
    seed: int = 0
    relative_step: float = 0.0  # each element moves by about this fraction of the parameters' root mean square
    window_evaluations: int = 0  # forward passes of the window the audit ran (each: loss_fn on every micro-batch)
    method: str = "central_difference"
    skipped: Optional[str] = None

    def summary(self):
        """One line for the log."""
        if self.skipped is not None:
            return f"gradient audit skipped: {self.skipped}"
        verdict = "ok" if self.ok else "MISMATCH"
        errors = ", ".join(f"{e:.2e}" for e in self.rel_errors)
        line = (f"gradient audit {verdict}: max relative error {self.max_rel_error:.3e} (tolerance "
                f"{self.tolerance:.1e}, {self.precision}, {len(self.rel_errors)} directions: {errors})")
        if not self.ok and self.dominant_groups:
            worst = {g.name: g for g in self.groups}
            parts = []
            for name in self.dominant_groups:
                err = worst[name].relative_error
                parts.append(name if err is None else f"{name} (relative error {err:.2e})")
            line += "; mismatch in " + ", ".join(parts)
        return line

    def __str__(self):
        return self.summary()
