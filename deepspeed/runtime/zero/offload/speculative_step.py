# SPDX-License-Identifier: Apache-2.0
"""Speculative offloaded steps (``offload_optimizer.super_offload``, ZeRO stages 1, 2 and 3).

The exact pipelined step (:mod:`~deepspeed.runtime.zero.offload.step_pipeline`) cannot start before ``engine.step()``:
clipping and the fp16 overflow check need the global gradient norm, which needs every gradient. A speculative
step starts earlier, betting that the step will neither clip nor overflow:

* **early start.** In the boundary backward (the last micro-step of the window), each bucket's gradient
  partition is final on the host once its fold completes (``HostFolder.after_fold`` hands the fold's handle
  over). The bucket's piece is then queued on the host step's worker, which waits for that fold and steps the
  piece with clipping coefficient 1, using the scalars (learning rate, betas, eps, weight decay, step count)
  read when the boundary backward folded its first bucket. Backward finalises buckets last layers first; the
  pieces are stepped in that order as they arrive; the ones still waiting when the backward ends are stepped in
  forward order (first layers first), still speculatively, while ``step()`` computes the norm.
  Nothing is uploaded yet: the device parameters stay the ones this window's forward and backward read
  (tied parameters, hooks and the norm see no half-updated weights), and the uploads, collectives included,
  are issued by the verdict on the caller's thread, in the same order on every rank as the exact step.
* **backup.** Each piece's op pass first writes the piece's master, moments and 16-bit target bits, as read,
  into backup buffers (``host_adam.StepBackup``, allocated once per param group: 12 bytes per element, plus
  2 for a 16-bit model; on the host, not page-locked).
* **verdict** (:meth:`SpeculativeStep.verdict`, at ``step()``, when the norm is known). Pieces not yet started
  are cancelled. If clipping would scale the gradient (coefficient below 1, or not finite), or the step
  overflowed, or a scalar of the step differs from the one used (an LR changed between backward and step),
  every speculatively stepped piece is **rolled back** from its backup (masters, moments, target bits, the
  step count; an optimizer state the speculation created is removed again) and the exact step runs. Otherwise
  the step continues as the exact step would: the pieces not yet stepped are stepped in forward order (the
  next forward's first layers wait only for their own pieces), and every piece is uploaded in forward order.
  Either way the bits are the exact step's: each element is updated once, by the same op with the same
  scalars and coefficient 1, from the same gradient.
* **other rollbacks.** A fold into a piece already queued (a second backward in the boundary micro-step, a
  late pass of reentrant checkpointing) rolls back at once ("regradient") and the window does not speculate
  again; so do a read of the masters or of the optimizer state before the verdict (``_masters_current``:
  accessors, checkpoints; "read") and a window discarded without a step (``zero_grad()``; "discarded").

ZeRO-3 (``Stage3``): the pieces are the overlapped step's (``UnitStep.speculative_pieces``: each unit's segment
of a group, in the next forward's gather order); a unit's fold in the boundary backward queues its pieces, and a
kept verdict hands them to ``HostStep.step_spans(begun=...)``, which steps the rest while the next forward's
gathers wait per unit. With ``offload_param`` the targets are the host shards every gather uploads from: the
speculative pieces write their 16-bit values into staging buffers (``staged_targets``) that a kept verdict copies
into the shards, so no gather before the verdict (a second forward in the boundary micro-step, an eval forward,
``GatheredParameters``) reads a speculative value, and a rollback leaves the shards as they are.

Adaptive policy: a window speculates only when the previous boundary step would not have rolled back for
clipping or overflow (its coefficient was 1 and its gradient finite); with clipping off and no overflow check
that holds every step, and only an LR change between backward and step can roll back. With a norm above the
clip threshold at every step, one step speculates and rolls back, the next ones do not speculate until the
norm falls below the threshold. :attr:`SpeculativeStep.stats` counts it all (``engine.optimizer.speculative_stats``).
"""

import logging
import math
import threading
import time

import torch

from deepspeed.ops.adam import host_adam
from deepspeed.runtime.zero.gradients.grad_pipeline import Phase
from deepspeed.runtime.zero.gradients.profiling import ds_range
from deepspeed.runtime.zero.offload.step_pipeline import StepPiece, StepPipeline
from deepspeed.utils.logging import logger

REASONS = ("clip", "overflow", "scalars", "regradient", "read", "discarded", "error")

NEEDS_PIPELINED_STEP = ("offload_optimizer.super_offload needs the pipelined offloaded step: DeepSpeedCPUAdam on the "
                        "host Adam op (a C++ compiler), a bf16/fp16 model (fp32 only with DS_NATIVE_CPU_ADAM=1), "
                        "float32 gradient accumulation and DS_OFFLOAD_OVERLAP not 0; see docs/offload.md")


def new_stats():
    """The counters of :class:`SpeculativeStep` (what ``speculative_stats`` shows)."""
    return {
        "boundary_steps": 0,  # boundary steps that reached the verdict (applied or skipped for overflow)
        "speculated": 0,  # windows whose boundary backward stepped at least one piece early, or queued one
        "kept": 0,  # speculated and kept: the step continued from them
        "rolled_back": 0,
        "not_speculated": 0,  # windows the adaptive policy kept exact (the previous step would have rolled back)
        "pieces_early": 0,  # pieces stepped before the verdict, in kept steps
        "pieces_rolled_back": 0,
        "reasons": {
            reason: 0
            for reason in REASONS
        },
    }


class _Speculation:
    """One window's speculative step."""

    def __init__(self, prepared, steps_before, created):
        self.prepared = prepared  # group -> (master, grad, state, scalars), as StepPipeline.prepare gives them
        self.steps_before = steps_before  # group -> its state's step count before this step was counted
        self.created = created  # groups whose optimizer state this speculation created
        self.queued = set()  # keys of the gradient pieces queued
        self.waiting = {}  # bucket index -> (StepPiece, wait for its fold): queued, not yet taken by the worker
        self.lock = threading.Lock()
        self.touched = []  # StepPieces whose step began (appended on the worker, before the op writes)
        self.cancelled = False


def bucket_pieces(stage):
    """ZeRO 1-2: each bucket's piece, keyed by its gradient partition piece, ranked by bucket index (a larger rank
    is needed earlier by the next forward)."""
    layout = stage.layout
    pieces = {}
    for bucket in layout.buckets:
        dest = layout.bucket_part(stage.geometry.grad_parts[bucket.group], bucket)
        if dest.numel():
            pieces[(dest.data_ptr(), dest.numel())] = (bucket.index,
                                                       StepPiece(bucket.group, bucket.part_offset, bucket.chunk))
    return pieces


class SpeculativeStep:
    """The speculative step of one partitioned stage with a pipelined host step (see the module docstring).

    ``pieces(stage)`` gives the step's pieces: ``{(data_ptr, numel) of the gradient partition piece a fold writes:
    (rank, StepPiece)}``, ranks distinct, a larger rank needed earlier by the next forward (default: ZeRO 1-2's
    buckets); it is read again when a window begins to speculate (ZeRO-3's order follows the traced forward).
    With ``staged_targets`` the speculative pieces write their 16-bit values into a buffer of their own, copied
    into the targets only by a kept verdict: targets that the backward reads (ZeRO-3's host shards under
    ``offload_param``, which a re-gather uploads) never hold a speculative value.
    """

    def __init__(self, stage, pieces=bucket_pieces, staged_targets=False):
        self.stage = stage
        self.host_step = stage.host_step
        self.pipeline = self.host_step.pipeline
        self._pieces_of = pieces
        self._pieces = pieces(stage)  # key of a gradient partition piece -> (rank, StepPiece)
        self._staged = {} if staged_targets else None  # group -> the speculative pieces' 16-bit values
        self._backups = None
        self._active = None
        self._closed_window = False  # this window speculates no more (spoiled, or the policy said no)
        self._previous_ok = True
        self.stats = new_stats()
        folder = stage.geometry.folder
        folder.barrier = self.barrier
        folder.before_fold = self.before_fold
        folder.after_fold = self.after_fold

    @property
    def active(self):
        return self._active is not None

    def backup_nbytes(self):
        """Host bytes of the backup buffers and staged targets (0 before the first speculation)."""
        staged = sum(t.numel() * t.element_size() for t in self._staged.values()) if self._staged else 0
        return staged + (sum(b.nbytes() for b in self._backups.values()) if self._backups else 0)

    # ---------------------------------------------------------- the folder's hooks
    def barrier(self):
        """Before the partitions are read or written by the norm or the step: a running exact step completes; a
        speculation needs nothing (it reads only pieces whose folds completed; settle zeroes only unfolded ones)."""
        if self._active is None:
            self.host_step.finish()

    def before_fold(self, piece):
        """Before ``piece`` is written: a piece already queued gets a new gradient, so the speculation is void."""
        spec = self._active
        if spec is None:
            self.host_step.finish()  # an exact step still reading the gradient completes first
        elif self._key(piece) in spec.queued:
            self._roll_back(self._take(), "regradient")
            self._closed_window = True

    def after_fold(self, piece, done):
        """``piece`` received a fold whose completion is ``done``: in the boundary backward, queue its step."""
        if self._closed_window or not self._in_boundary_backward():
            return
        spec = self._active
        if spec is None:
            if not self._previous_ok:
                self.stats["not_speculated"] += 1
                self._closed_window = True
                return
            spec = self._open()
        key = self._key(piece)
        found = self._pieces.get(key)
        if found is None or found[1].group not in spec.prepared:
            return
        spec.queued.add(key)
        with spec.lock:
            spec.waiting[found[0]] = (found[1], getattr(done, "wait_done", None) or done.synchronize)
        pipeline = self.pipeline
        backward = self.stage.pipeline

        def run():
            # One queued piece per task; which one is chosen when the worker gets to it: during the backward the
            # oldest (buckets become final last layers first), after it the first in forward order.
            if spec.cancelled:
                return
            with spec.lock:
                if not spec.waiting:
                    return
                index = min(spec.waiting) if backward.phase is Phase.BACKWARD else max(spec.waiting)
                step_piece, wait = spec.waiting.pop(index)
            wait()  # the fold's copy and add completed: the piece holds the window's gradient
            if spec.cancelled:
                return
            delay = StepPipeline.piece_delay
            if delay:
                time.sleep(delay)
            spec.touched.append(step_piece)
            with ds_range("DS::speculative_piece"):
                g = step_piece.group
                pipeline.step_host_piece(spec.prepared[g], step_piece, 1.0, self._backups[g], self._out(g))

        pipeline.host_worker().submit(run)

    # -------------------------------------------------------------- the verdict
    def verdict(self, grad_scale, before_write=None):
        """At the step, ``grad_scale`` being the clipping coefficient: ``(prepared, stepped)`` to continue a kept
        speculation with (``HostStep.step_and_gather`` / ``step_spans(begun=...)``), or None (none, or rolled back:
        step exactly). Staged targets of a kept speculation are copied into the targets first, once nothing reads
        them (``before_write``: other readers, as ``HostStep.step`` takes it)."""
        self.stats["boundary_steps"] += 1
        self._previous_ok = grad_scale == 1.0
        spec = self._take()
        if spec is None:
            return None
        reason = None
        if grad_scale != 1.0:
            reason = "clip" if math.isfinite(grad_scale) else "overflow"
        elif self._scalars_changed(spec):
            reason = "scalars"
        if reason is not None:
            self._roll_back(spec, reason)
            return None
        if self._staged is not None and spec.touched:
            host_step = self.host_step
            host_step.wait_readers(before_write)
            with ds_range("DS::speculative_commit"), torch.no_grad():
                for piece in spec.touched:
                    span = (0, piece.start, piece.length)
                    host_step.targets[piece.group].narrow(*span).copy_(self._staged[piece.group].narrow(*span))
        self.stats["kept"] += 1
        self.stats["pieces_early"] += len(spec.touched)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(f"super_offload: step kept, {len(spec.touched)} of {len(self._pieces)} pieces stepped early; "
                         f"{self.stats}")
        return spec.prepared, {(p.group, p.start) for p in spec.touched}

    def overflow(self):
        """The boundary step is skipped (a non-finite gradient): undo what the speculation stepped."""
        self.stats["boundary_steps"] += 1
        self._previous_ok = False
        spec = self._take()
        if spec is not None:
            self._roll_back(spec, "overflow")

    def before_read(self):
        """Someone reads or writes the masters or the optimizer state before the verdict: undo the speculation."""
        spec = self._take()
        if spec is not None:
            self._roll_back(spec, "read")
            self._closed_window = True

    def new_window(self):
        """The window ends (after its step, or discarded): a speculation still pending is undone."""
        spec = self._take()
        if spec is not None:
            self._roll_back(spec, "discarded")
        self._closed_window = False

    def close(self):
        self.new_window()

    # -------------------------------------------------------------- internals
    @staticmethod
    def _key(piece):
        return (piece.data_ptr(), piece.numel())

    def _out(self, g):
        """Where group ``g``'s speculative pieces write their 16-bit values (None: the targets)."""
        return self._staged[g] if self._staged is not None else None

    def _in_boundary_backward(self):
        stage = self.stage
        clock = stage.clock
        return stage.pipeline.phase is Phase.BACKWARD and clock.at_boundary() and not clock.deferred()

    def _open(self):
        """Begin this window's speculation: the step is counted and its scalars read now."""
        host_step = self.host_step
        host_step.wait_readers()  # the previous step and the copies reading its targets are complete
        optimizer = host_step.optimizer
        masters = host_step.masters
        steps_before, created = {}, set()
        for g, master in enumerate(masters):
            state = optimizer.state.get(master)
            if state:
                step = state["step"]
                steps_before[g] = step.clone() if torch.is_tensor(step) else step
            else:
                created.add(g)
        self._pieces = self._pieces_of(self.stage)
        prepared = self.pipeline.prepare()
        if self._staged is not None:
            for g in prepared:
                if g not in self._staged:
                    self._staged[g] = torch.empty_like(host_step.targets[g])
        self._backups = self._backups or {}
        for g in prepared:
            if g not in self._backups:
                self._backups[g] = host_adam.StepBackup(masters[g], host_step.targets[g].dtype)
        self.stats["speculated"] += 1
        self._active = _Speculation(prepared, steps_before, created)
        return self._active

    def _take(self):
        """End the active speculation: cancel what has not started, wait for what has; return it (or None)."""
        spec, self._active = self._active, None
        if spec is None:
            return None
        spec.cancelled = True
        try:
            with ds_range("DS::speculative_wait"):
                self.pipeline.host_worker().drain()
        except BaseException:
            self._roll_back(spec, "error")
            raise
        return spec

    def _scalars_changed(self, spec):
        groups = self.host_step.optimizer.param_groups
        for g, (_, _, state, scalars) in spec.prepared.items():
            if host_adam.step_scalars(groups[g], float(state["step"])) != scalars:
                return True
        return False

    def _roll_back(self, spec, reason):
        """Put every piece the speculation stepped back as it was, and the step counts."""
        host_step = self.host_step
        optimizer = host_step.optimizer
        with ds_range("DS::speculative_rollback"), torch.no_grad():
            for piece in spec.touched:
                master, _, state, _ = spec.prepared[piece.group]
                out = self._out(piece.group)
                if out is None:
                    out = host_step.targets[piece.group]
                self._backups[piece.group].restore(master, state, out, piece.start, piece.length)
            for g in spec.prepared:
                master = host_step.masters[g]
                if g in spec.created:
                    optimizer.state.pop(master, None)
                else:
                    optimizer.state[master]["step"] = spec.steps_before[g]
        self.stats["rolled_back"] += 1
        self.stats["pieces_rolled_back"] += len(spec.touched)
        self.stats["reasons"][reason] += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(f"super_offload: rolled back ({reason}), {len(spec.touched)} pieces restored; {self.stats}")
