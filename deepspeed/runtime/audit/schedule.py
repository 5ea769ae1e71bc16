# SPDX-License-Identifier: Apache-2.0
"""The audit as part of training: the ``gradient_audit`` config section, run at accumulation boundaries.

:class:`AuditSchedule` is the engine's side of it. The engine calls it from four places:
``forward`` (:meth:`~AuditSchedule.on_forward`), ``step`` at a boundary before the optimizer
step (:meth:`~AuditSchedule.before_step`), ``zero_grad`` (:meth:`~AuditSchedule.discard_window`)
and the public methods ``audit_gradients``, ``set_audit_loss_fn`` and ``record_audit_batch``.

Which steps are audited: optimizer steps ``0, n, 2n, ...`` (``global_steps % every_n_steps == 0``
at the boundary), so the first step of a job is always checked.

The window's micro-batches. ``loss_fn(engine, batch)`` needs each micro-step's batch again:

* by default every call of the engine's forward with gradients enabled, in an audited window,
  is one micro-batch: ``batch`` is a :class:`ForwardInputs` (``args``, ``kwargs``: the
  forward's arguments, detached), so ``loss_fn`` typically calls
  ``engine(*batch.args, **batch.kwargs)`` and computes the loss from its output (a model
  that takes its labels and returns its loss, as Transformers models do, needs nothing else);
* when the loss needs more than the forward's inputs (targets kept outside the model), the
  training loop calls ``engine.record_audit_batch(batch)`` once per micro-step, with whatever
  ``loss_fn`` should receive; from the first such call on, this engine records only those.

Each micro-batch keeps the random generators' state of the moment it was recorded (the
start of the forward, or the ``record_audit_batch`` call), and its loss is evaluated from
that state: a model with dropout sees the masks it saw in training, so the audited function
is the one whose gradient was accumulated.

The result goes to the log (rank 0: the summary line; a mismatch: a warning on every rank)
and to the monitor as ``Train/Audit/rel_error`` at step ``global_samples`` (before the update,
as ``Train/Samples/train_loss``). With ``on_mismatch: "raise"`` a mismatch raises
:class:`GradientAuditError` on every rank before the optimizer steps, so the wrong gradient
is never applied.
"""

import logging
from dataclasses import dataclass

import torch

from deepspeed.runtime.audit.auditor import GradientAuditor, RngState, auditing
from deepspeed.utils.logging import log_dist

MONITOR_EVENT = "Train/Audit/rel_error"


class GradientAuditError(RuntimeError):
    """A gradient audit found a mismatch (``on_mismatch: "raise"``); ``report`` is the :class:`AuditReport`."""

    def __init__(self, report):
        super().__init__(report.summary())
        self.report = report


@dataclass(frozen=True)
class ForwardInputs:
    """The arguments of one call of the engine's forward (tensors detached)."""
    args: tuple
    kwargs: dict


def _detached(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, tuple):
        return tuple(_detached(o) for o in obj)
    if isinstance(obj, list):
        return [_detached(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    return obj


class AuditSchedule:
    """See the module docstring. ``config`` is the parsed ``gradient_audit`` section."""

    def __init__(self, engine, config):
        self.engine = engine
        self.config = config
        self.auditor = GradientAuditor(engine)
        self.loss_fn = None
        self.explicit = False
        self._batches = []  # (batch, RngState) of the window being recorded
        self.last_report = None

    # ----------------------------------------------------------- user API
    def audit(self, loss_fn, micro_batches, directions=4, seed=None, tolerance=None, group_by=None):
        return self.auditor.run(loss_fn,
                                micro_batches,
                                directions=directions,
                                seed=seed,
                                tolerance=tolerance,
                                group_by=group_by)

    def set_loss_fn(self, loss_fn):
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"set_audit_loss_fn expects a callable(engine, batch) or None, got "
                            f"{type(loss_fn).__name__}")
        self.loss_fn = loss_fn

    def record(self, batch):
        """The training loop hands over one micro-step's batch (see the module docstring)."""
        if not self.explicit:
            self.explicit = True
            self._batches = []  # forward inputs recorded so far in this window are not wanted
        if self._recording():
            self._batches.append((batch, RngState()))

    # ------------------------------------------------------------- hooks
    def _due(self):
        return self.config.enabled and self.engine.global_steps % self.config.every_n_steps == 0

    def _recording(self):
        return self._due() and not auditing()

    def on_forward(self, inputs, kwargs):
        """Start of an engine forward: in an audited window, keep its inputs and the generators' state."""
        if not self.config.enabled or self.explicit or not torch.is_grad_enabled() or not self._recording():
            return
        self._batches.append((ForwardInputs(_detached(inputs), _detached(kwargs)), RngState()))

    def discard_window(self):
        """``zero_grad``: the window's gradient was discarded, so are its micro-batches."""
        self._batches = []

    def before_step(self):
        """At a boundary ``step()``, before the optimizer step: run the audit if this step is due."""
        if not self.config.enabled:
            return
        batches, self._batches = self._batches, []
        stage = self.engine._stage
        if not self._due() or stage is None or self.engine.optimizer is None or stage.window_is_empty():
            return
        if self.loss_fn is None:
            raise RuntimeError("gradient_audit is enabled but no loss function is registered: call "
                               "engine.set_audit_loss_fn(fn) with fn(engine, batch) -> one micro-step's loss")
        report = self.auditor.run(self.loss_fn, [b for b, _ in batches],
                                  directions=self.config.directions,
                                  tolerance=self.config.tolerance,
                                  rng_states=[rng for _, rng in batches])
        self.last_report = report
        self._publish(report)

    def _publish(self, report):
        engine = self.engine
        if report.skipped is not None:
            log_dist(f"step {engine.global_steps}: {report.summary()}", ranks=[0])
            return
        engine.monitor.write_events([(MONITOR_EVENT, report.max_rel_error, engine.global_samples)])
        if report.ok:
            log_dist(f"step {engine.global_steps}: {report.summary()}", ranks=[0])
            return
        if self.config.on_mismatch == "raise":
            raise GradientAuditError(report)
        log_dist(f"step {engine.global_steps}: {report.summary()}", ranks=[-1], level=logging.WARNING)
