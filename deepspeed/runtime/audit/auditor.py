# SPDX-License-Identifier: Apache-2.0
"""The gradient audit: is the gradient the optimizer is about to use the derivative of the window's loss?

The function. With ``W`` data-parallel ranks, ``GAS`` micro-steps per window and ``D = W``
(``gradient_allreduce_op`` mean) or ``1`` (sum), the gradient contract says that at the
boundary the window gradient of an engine is the gradient, with respect to that engine's
parameters, of

    F(theta) = (1 / D) * sum over ranks r of (1 / GAS) * sum over r's micro-batches b of loss_fn(engine, b)

``loss_fn(engine, batch)`` recomputes one micro-step's loss (with ``scale_wrt_gas=False`` it
returns the loss times GAS; with several backward calls per micro-step, their sum).

The check, for each of ``directions`` random directions ``v`` (see ``directions.py``):

1. every rank moves its fp32 pieces of the engine's parameters to ``theta + h v`` and puts
   them into the model (``pieces.py``); every rank evaluates its micro-batches' losses (forward
   only, ``torch.no_grad``); then the same at ``theta - h v``;
2. during the first move each rank also sums ``<g, d>`` over its own pieces, ``g`` its piece
   of the window gradient, ``d`` the realized move of its piece;
3. one all-reduce brings every rank's sums together; ``report.py`` compares
   ``F(+) - F(-)`` with ``<g, d>``.

``h`` is a fixed fraction (by precision) of the root mean square of the engine's parameters,
the same for every element. The derivative comes from forward passes only, so nothing of
the backward path (hooks, the session, scaling, reduction, partitioning) takes part in it.
Applied shard-locally, the central difference never materialises a whole direction: its
memory is one fp32 copy of this rank's pieces (to restore them bit for bit) and a few
chunks of directions.

When a direction fails and there are several groups, each group is checked on its own
along the first two directions restricted to it (four more window evaluations per group);
the groups whose own check fails are named in the report.

What the audit leaves as it found: the window gradient (it is only read), the fp32 values
and the model's parameters (restored bit for bit from a saved copy of this rank's pieces,
then refreshed), and the CPU and CUDA random number generators (saved before, restored
after). Every rank issues the same collectives in the same order, and the report is
computed from all-reduced numbers, so it is the same on every rank. Bad arguments raise on
every rank before any collective; a different number of micro-batches on some rank raises
on every rank after one small all-reduce.
"""

import contextlib
import math

import torch

import deepspeed.comm as dist
from deepspeed.runtime.audit.directions import DirectionStream, mix_seed
from deepspeed.runtime.audit.pieces import LocalPieces
from deepspeed.runtime.audit.report import (AuditReport, DirectionResult, GroupResult, compute_precision,
                                            default_tolerance, error_scale, relative_error, relative_step)
from deepspeed.runtime.zero.gradients.profiling import ds_range

AUDIT_SEED = 0x6175646974  # the default seed is mixed from this and the engine's global step
# Directions per group when a mismatch is localised: one is too noisy in bf16 for a group with a
# small share of the loss's sensitivity; each costs two window evaluations per group.
LOCAL_DIRECTIONS = 2

_active = [0]


def auditing():
    """Whether a gradient audit is running in this process (engine forwards then neither record nor time)."""
    return _active[0] > 0


@contextlib.contextmanager
def _running():
    _active[0] += 1
    try:
        yield
    finally:
        _active[0] -= 1


class RngState:
    """The CPU generator's state and, where CUDA is in use, every CUDA device's."""

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None

    def apply(self):
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def _rows(vector, stage):
    """Every rank's ``vector`` as the rows of a ``[W, n]`` float64 tensor (one all-reduce; same on every rank)."""
    vector = vector.to(device=stage.device, dtype=torch.float64).reshape(-1)
    world = stage.world_size
    if world == 1:
        return vector.unsqueeze(0)
    rows = torch.zeros(world, vector.numel(), dtype=torch.float64, device=stage.device)
    rows[stage.rank] = vector
    dist.all_reduce(rows, group=stage.group)
    return rows


def _check_arguments(loss_fn, micro_batches, directions, tolerance, group_by):
    if not callable(loss_fn):
        raise TypeError(f"audit_gradients: loss_fn must be a callable(engine, batch), got {type(loss_fn).__name__}")
    if isinstance(micro_batches, (str, bytes)) or not hasattr(micro_batches, "__iter__"):
        raise TypeError("audit_gradients: micro_batches must be a list of this rank's micro-batches of the window, "
                        f"got {type(micro_batches).__name__}")
    if isinstance(directions, bool) or not isinstance(directions, int) or directions < 1:
        raise ValueError(f"audit_gradients: directions must be an integer >= 1, got {directions!r}")
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                  or not tolerance > 0 or not math.isfinite(tolerance)):
        raise ValueError(f"audit_gradients: tolerance must be a positive number or None, got {tolerance!r}")
    if group_by is not None and not callable(group_by):
        raise TypeError(f"audit_gradients: group_by must be None or a callable(name) -> label, got "
                        f"{type(group_by).__name__}")


class GradientAuditor:
    """Runs audits of one engine's gradient (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine

    def run(self, loss_fn, micro_batches, directions=4, seed=None, tolerance=None, group_by=None, rng_states=None):
        """Audit the window gradient; returns an :class:`AuditReport` (equal on every rank).

        Call it after the last backward of the window and before ``step()``. ``rng_states``
        (one :class:`RngState` per micro-batch, or None) is the generator state each
        micro-batch's loss is evaluated from; by default every evaluation starts from the state
        at the call, so a model with dropout sees the same masks in every evaluation.
        """
        engine = self.engine
        stage = engine._stage
        if stage is None or engine.optimizer is None:  # a ZeRO-3 engine without one has a stage that steps nothing
            raise RuntimeError("audit_gradients needs an engine with an optimizer (there is no gradient to audit)")
        _check_arguments(loss_fn, micro_batches, directions, tolerance, group_by)
        batches = list(micro_batches)
        if rng_states is not None and len(rng_states) != len(batches):
            raise ValueError("audit_gradients: one generator state per micro-batch is needed")
        if stage.window_is_empty():
            raise RuntimeError("audit_gradients: no backward reached this engine since the last step; call it after "
                               "the window's last backward and before engine.step()")
        with ds_range("DS::gradient_audit"):
            return self._run(stage, loss_fn, batches, directions, seed, tolerance, group_by, rng_states)

    def _run(self, stage, loss_fn, batches, directions, seed, tolerance, group_by, rng_states):
        engine = self.engine
        stage.finish_window()
        pieces = LocalPieces(stage, engine.module, group_by)
        theta_sq, grad_sq = pieces.local_sums()
        groups, params = len(pieces.labels), len(pieces.param_numel)
        count = torch.tensor([float(len(batches))], dtype=torch.float64)
        stats = _rows(torch.cat([count, theta_sq.cpu(), grad_sq.cpu()]), stage)
        counts = [int(c) for c in stats[:, 0].tolist()]
        if len(set(counts)) > 1:
            raise ValueError(f"audit_gradients: every rank must pass its micro-batches of the same window; the ranks "
                             f"passed {counts} micro-batches")
        if counts[0] == 0:
            raise ValueError("audit_gradients: micro_batches is empty")
        replicated = bool(stage.geometry.replicated)
        # Replicated: every rank holds the whole model; rank 0's sums make the steps the same everywhere.
        theta = stats[0, 1:1 + params] if replicated else stats[:, 1:1 + params].sum(0)
        grad_rows = stats[:, 1 + params:] if replicated else stats[:, 1 + params:].sum(0, keepdim=True)  # [R, P]
        precision = compute_precision(stage.config.model_dtype, engine.module)
        tol = float(tolerance) if tolerance is not None else default_tolerance(precision)
        seed = int(seed) if seed is not None else mix_seed(AUDIT_SEED, engine.global_steps)
        eta = relative_step(precision)
        common = dict(tolerance=tol, precision=precision, seed=seed, relative_step=eta)
        if stage.config.requires_loss_scale and not bool(torch.isfinite(grad_rows).all()):
            return AuditReport(ok=True,
                               max_rel_error=0.0,
                               rel_errors=(),
                               skipped="the fp16 window gradient overflowed; the step will be skipped and the loss "
                               "scale lowered",
                               **common)
        steps = _steps(theta.tolist(), pieces.param_numel, eta)
        pieces.set_steps(steps)
        stream = DirectionStream(seed)
        start_rng = RngState()
        window = _Window(engine, loss_fn, batches, rng_states or [start_rng] * len(batches), stage.device)
        pieces.save()
        try:
            with torch.no_grad(), _running():
                moves, losses = [], []
                for k in range(directions):
                    moves.append(pieces.perturb(stream, k, +1, measure=True))
                    pieces.refresh()
                    losses.append(window.loss())
                    pieces.perturb(stream, k, -1)
                    pieces.refresh()
                    losses.append(window.loss())
                local = torch.cat([torch.stack(losses), torch.stack(moves).reshape(-1)])
                rows = _rows(local, stage)
                result = _Evaluation(stage, pieces, rows, grad_rows, steps, directions, replicated)
                dirs = [result.direction(k) for k in range(directions)]
                ok = all(d.relative_error <= tol for d in dirs)
                group_errors = None
                if not ok and groups > 1:
                    group_errors = self._localize(stage, pieces, stream, window, result)
        finally:
            pieces.restore()
            pieces.refresh()
            pieces.drop_saved()
            start_rng.apply()

        rel = tuple(d.relative_error for d in dirs)
        group_results, dominant = _groups(pieces, result, group_errors, ok, tol, max(rel))
        return AuditReport(ok=ok,
                           max_rel_error=max(rel),
                           rel_errors=rel,
                           dominant_groups=dominant,
                           directions=tuple(dirs),
                           groups=group_results,
                           window_evaluations=window.evaluations,
                           **common)

    @staticmethod
    def _localize(stage, pieces, stream, window, result):
        """Per group: the check along the first directions restricted to the group (``<g, d>`` of each group is
        known from the main pass); ``{group: (error, |gd - dF|)}``."""
        losses = []
        for g in range(len(pieces.labels)):
            if pieces.group_numel[g] == 0:
                continue
            pieces.restore()
            for k in range(result.local_directions):
                pieces.perturb(stream, k, +1, group=g)
                pieces.refresh()
                losses.append(window.loss())
                pieces.perturb(stream, k, -1, group=g)
                pieces.refresh()
                losses.append(window.loss())
        rows = _rows(torch.stack(losses), stage)
        return result.groups(rows)


class _Window:
    """This rank's part of the window's loss: ``sum over its micro-batches of loss_fn(engine, b)`` (float64)."""

    def __init__(self, engine, loss_fn, batches, rng_states, device):
        self.engine = engine
        self.loss_fn = loss_fn
        self.batches = batches
        self.rng_states = rng_states
        self.device = device
        self.evaluations = 0

    def loss(self):
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch, rng in zip(self.batches, self.rng_states):
            rng.apply()
            loss = self.loss_fn(self.engine, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"shape {tuple(loss.shape)}"
                raise TypeError(f"audit_gradients: loss_fn must return a scalar tensor (one micro-step's loss), got "
                                f"{what}")
            total += loss.detach().reshape(()).to(device=self.device, dtype=torch.float64)
        self.evaluations += 1
        return total


class _Evaluation:
    """The all-reduced sums of the directions, turned into per-direction and per-group results."""

    def __init__(self, stage, pieces, rows, grad_rows, steps, directions, replicated):
        gas = stage.clock.gradient_accumulation_steps()
        divisor = stage.world_size if stage.config.average else 1
        self.scale = 1.0 / (gas * divisor)
        self.local_directions = min(directions, LOCAL_DIRECTIONS)
        self.group_numel = pieces.group_numel
        groups = len(pieces.labels)
        losses = rows[:, :2 * directions].sum(0)  # every rank's micro-batches count
        self.df = ((losses[0::2] - losses[1::2]) * self.scale).tolist()
        moves = rows[:, 2 * directions:].cpu().reshape(rows.shape[0], directions, 2, groups)
        if not replicated:
            moves = moves.sum(0, keepdim=True)
        else:
            _check_same_moves(moves[:, :, 1, :])
        self.moves = moves  # [rows, directions, (<g, d>, <d, d>), groups]
        # Per row and group: |g|^2, and the typical <g, d>^2 of a random move (d = 2 step v, v standard normal).
        member = torch.zeros(len(pieces.param_numel), groups, dtype=torch.float64)
        member[torch.arange(len(pieces.param_numel)), torch.tensor(pieces.param_group, dtype=torch.long)] = 1.0
        grad_rows = grad_rows.cpu()
        self.grad_sq = grad_rows @ member
        self.typical_sq = (grad_rows * (2.0 * torch.tensor(steps, dtype=torch.float64))**2) @ member

        # The loss change per unit move along each direction (the moves are the same on every row).
        self.unit_changes = [
            df / math.sqrt(dd) if dd > 0 else 0.0 for df, dd in zip(self.df, moves[0, :, 1].sum(-1).tolist())
        ]

    def direction(self, k):
        worst = None
        for r in range(self.moves.shape[0]):
            gd = float(self.moves[r, k, 0].sum())
            dd = float(self.moves[r, k, 1].sum())
            scale = error_scale(math.sqrt(dd), self.unit_changes, math.sqrt(float(self.typical_sq[r].sum())))
            err = relative_error(gd, self.df[k], scale)
            if worst is None or not err <= worst[0]:
                worst = (err, gd, dd)
        err, gd, dd = worst
        norm = math.sqrt(dd) if dd > 0 else 1.0
        return DirectionResult(index=k,
                               relative_error=err,
                               directional_derivative=self.df[k] / norm,
                               gradient_projection=gd / norm)

    def groups(self, rows):
        """``{group: (relative error, |gd - dF|)}`` of the per-group checks whose losses are ``rows``."""
        losses = rows.sum(0)
        df = ((losses[0::2] - losses[1::2]) * self.scale).tolist()
        n = self.local_directions
        out = {}
        at = 0
        for g, numel in enumerate(self.group_numel):
            if numel == 0:
                continue
            dfs = df[at:at + n]
            at += n
            moves = [math.sqrt(float(self.moves[0, k, 1, g])) for k in range(n)]
            units = [d / m for d, m in zip(dfs, moves) if m > 0]
            worst = None
            for r in range(self.moves.shape[0]):
                typical = math.sqrt(float(self.typical_sq[r, g]))
                for k in range(n):
                    gd = float(self.moves[r, k, 0, g])
                    err = relative_error(gd, dfs[k], error_scale(moves[k], units, typical, self.unit_changes))
                    gap = abs(gd - dfs[k]) if math.isfinite(gd - dfs[k]) else math.inf
                    if worst is None or not err <= worst[0]:
                        worst = (err, gap)
            out[g] = worst
        return out


def _steps(theta_sq, numels, eta):
    """Per parameter, the move per unit of ``v``: ``eta`` times the root mean square of all the parameters.

    One step for every element makes the direction isotropic, so every element's gradient counts
    alike. Measured against moving each parameter by ``eta`` times its own root mean square, it
    gave smaller errors for the true gradient and larger ones for wrong gradients in bf16 (small
    weights moved by a small fraction of themselves move mostly by rounding); see docs/audit.md.
    """
    total = sum(theta_sq)
    overall = math.sqrt(total / max(sum(numels), 1)) if total > 0 else 1.0
    return [eta * overall] * len(numels)


def _check_same_moves(move_sq):
    """Replicated stages: every rank must have moved its (whole) parameters by the same amount."""
    reference = move_sq[0]
    if not torch.allclose(move_sq, reference.expand_as(move_sq), rtol=1e-6, atol=0.0):
        raise RuntimeError("audit_gradients: the ranks drew different directions (their random generators disagree; "
                           "are the devices of different kinds?); the audit cannot be run on this job")


def _groups(pieces, result, group_errors, ok, tol, max_rel):
    grad_norms = result.grad_sq.max(0).values.sqrt().tolist()
    results = []
    for g, name in enumerate(pieces.labels):
        err = None
        if group_errors is not None and g in group_errors:
            err = group_errors[g][0]
        elif not ok and len(pieces.labels) == 1:
            err = max_rel
        results.append(
            GroupResult(index=g,
                        name=name,
                        numel=pieces.group_numel[g],
                        grad_norm=grad_norms[g],
                        relative_error=err,
                        mismatch=err is not None and not err <= tol))
    if ok:
        return tuple(results), ()
    if group_errors is None:
        return tuple(results), tuple(r.name for r in results if r.mismatch)
    failing = [g for g, (err, _) in group_errors.items() if not err <= tol]
    if not failing:  # no group fails alone: name the one with the largest discrepancy
        failing = [max(group_errors, key=lambda g: group_errors[g][1])]
    failing.sort(key=lambda g: -group_errors[g][1])
    return tuple(results), tuple(pieces.labels[g] for g in failing)
