# SPDX-License-Identifier: Apache-2.0
"""``load_checkpoint``: read and check everything first, agree, then change the engine.

The saved checkpoint may come from any stage and world size (:class:`SavedCheckpoint`
reads either layout); the engine's stage is reached only through its
:class:`~deepspeed.runtime.checkpoint.stage_checkpoint.StageCheckpoint`.

Phase 1 (local, every rank): resolve the tag (``latest`` when None), read the
model-states file, check the module's keys and full shapes against the checkpoint, and
read what the optimizer needs: a stage-0 checkpoint's state from the model-states file,
or, when the stage says it may load this rank's own optimizer file as it is (same stage
family, world size and layout), only that file. The ranks agree on the outcome (one
``all_gather_object``): nothing to load on every rank gives ``(None, None)``; any error
raises on every rank.

Phase 2 (only when some rank cannot use its own file: another world size, stage or
layout, or a stage-3 checkpoint whose parameters this engine needs whole): every rank
reads every saved rank's file and rebuilds the state by parameter name (a ``FullState``),
which the stage checks against its own layout. The ranks agree again.

Apply: the accumulation window is discarded and the module loaded
(``StageCheckpoint.import_module``; the ranks agree once more: a ``custom_load_fn`` may
raise); then the stage's ``apply()`` (the fp32 masters and inner optimizer state; it may
be collective), the loss scaler, the LR scheduler and the counters.

What is restored, by argument: ``load_module_only`` loads only the module (fp32 masters
are refreshed from it; a stage-3 checkpoint keeps the parameters' values as fp32
masters, which are loaded); otherwise the fp32 masters come from the checkpoint's fp32
values, the inner optimizer state only with ``load_optimizer_states``, the scheduler only
with ``load_lr_scheduler_states``; counters (``global_steps``, ``global_samples``,
``skipped_steps``) unless ``load_module_only``. The client state returned is upstream's
(``model_state.client_state_of``).
"""

from deepspeed.checkpoint.constants import LATEST_UNIVERSAL_FILE
from deepspeed.runtime.checkpoint import expert as expert_checkpoint
from deepspeed.runtime.checkpoint import completeness
from deepspeed.runtime.checkpoint.model_state import check_module, client_state_of, param_names
from deepspeed.runtime.checkpoint.optimizer_state import import_scaler
from deepspeed.runtime.checkpoint.reader import resolve_tag
from deepspeed.runtime.checkpoint.saved import SavedCheckpoint
from deepspeed.runtime.checkpoint.saving import agreement_group, check_stage, parallel_ranks
from deepspeed.runtime.checkpoint.stage_checkpoint import checkpoint_of
from deepspeed.runtime.checkpoint.validate import CheckpointError, agree, check_dir
from deepspeed.utils.logging import logger


class _Load:
    """The state of one ``load_checkpoint`` call across its phases (see the module docstring)."""

    def __init__(self, engine, load_module_strict, load_optimizer_states, load_module_only, custom_load_fn):
        self.engine = engine
        self.stage = checkpoint_of(engine)
        self.has_optimizer = self.stage.has_optimizer
        self.strict = load_module_strict and custom_load_fn is None
        self.load_optimizer_states = load_optimizer_states
        self.module_only = load_module_only
        self.custom_load_fn = custom_load_fn
        self.name_of = param_names(engine.module)
        self.dp_rank, self.mp_rank = parallel_ranks(engine)
        self.tag = None
        self.reason = None
        self.saved = None
        self.module_values = None
        self.scaler = None  # the payload holding the saved loss-scaler state
        self.apply_optimizer = None
        self.refresh_masters = False
        self.needs_all_files = False
        self.with_state = False  # the optimizer state is loaded too (phase 2 rebuilds it)
        self.experts_resharded = False  # saved at another expert-parallel size (runtime/checkpoint/expert.py)

    def _local(self, values):
        """A tensor-parallel engine keeps this rank's piece of every whole tensor (a universal folder's)."""
        if self.engine.mp_world_size == 1 or values is None:
            return values
        from deepspeed.runtime.tensor_parallel.checkpoint import localize
        return localize(self.engine.module, values)

    @property
    def model_path(self):
        return None if self.saved is None else self.saved.model_path

    # ----------------------------------------------------------- phase 1
    def read(self, load_dir, tag):
        load_dir = check_dir(load_dir, "load_checkpoint")
        universal = bool(getattr(self.engine._config, "load_universal_checkpoint", False))
        self.tag, self.reason = resolve_tag(load_dir, tag, latest=LATEST_UNIVERSAL_FILE if universal else None)
        if self.tag is None:
            return
        try:
            self.saved = saved = SavedCheckpoint(load_dir,
                                                 self.tag,
                                                 self.dp_rank,
                                                 universal=universal,
                                                 mp_rank=self.mp_rank,
                                                 mp_size=self.engine.mp_world_size)
        except CheckpointError as exc:
            explained = exc if universal else completeness.explain_missing(load_dir, self.tag, exc)
            if explained is exc:
                raise
            raise explained from exc
        if not universal and saved.reader is None:  # a folder a converter made carries the source's records
            completeness.check_complete(load_dir, self.tag, saved.meta)
        shapes, values = saved.saved_shapes(), saved.module_values()
        self.experts_resharded = expert_checkpoint.resharding(self.engine, saved.directory)
        if self.experts_resharded and saved.reader is None:  # another ep size: this rank's experts, per-expert files
            values, shapes = expert_checkpoint.local_module_values(self.engine, saved.directory, values, shapes)
        elif self.experts_resharded:  # upstream's AutoEP: its reader stacks every expert; this rank keeps its own
            values = expert_checkpoint.localize_global_experts(self.engine, dict(values))
            shapes = expert_checkpoint.localize_global_experts(self.engine, dict(shapes))
        check_module(shapes, self.engine.module, self.strict, saved.model_path)
        self.module_values = self._local(values)
        if saved.per_rank:
            self._read_per_rank()
        elif self.has_optimizer:
            self._read_replicated()

    def _read_per_rank(self):
        """A stage-3 checkpoint: the parameters live in the optimizer files, even for ``load_module_only``."""
        self.with_state = self.has_optimizer and self.load_optimizer_states and not self.module_only
        self.needs_all_files = True
        if self.has_optimizer:
            self._try_own_partition()

    def _read_replicated(self):
        """A checkpoint of stages 0-2: the module is in the model-states file; the masters come from the optimizer."""
        saved = self.saved
        if self.module_only:
            self.refresh_masters = True
            return
        if not saved.has_optimizer:
            if self.load_optimizer_states:
                raise CheckpointError(f"{saved.model_path}: the checkpoint holds no optimizer state (it was saved by "
                                      f"an engine without an optimizer); load with load_module_only=True or "
                                      f"load_optimizer_states=False")
            self.refresh_masters = True
            return
        self.with_state = self.load_optimizer_states
        if saved.saved_stage == 0:
            names = [self.name_of[p] for group in self.stage.param_groups() for p in group]
            full, self.scaler = saved.stage0_full_state(names)
            full = self._local(full)
            self.apply_optimizer = self.stage.prepare_import(full, self.with_state, self.name_of, saved.model_path)
            return
        if saved.saved_stage not in (1, 2):
            raise CheckpointError(f"{saved.model_path}: the checkpoint does not say which ZeRO stage wrote it; it was "
                                  f"not written by this runtime. Load with load_module_only=True")
        self.needs_all_files = True
        self._try_own_partition()

    def _try_own_partition(self):
        """Load this rank's own optimizer file as it is when the stage says it was saved in its layout."""
        saved = self.saved
        if saved.reader is not None:
            return  # another format (upstream's, universal) never fits this runtime's layout: phase 2 reads it by name
        files = saved.optim_files()  # a wrong listing is an error of this phase
        if not self.stage.reads_own_file(saved.saved_stage) or len(files) != self.engine.seq_dp_world_size:
            return
        own = saved.own_partition(self.dp_rank)
        if self.stage.fits(own.saved, self.name_of):
            self.scaler = own.saved
            self.apply_optimizer = self.stage.prepare_import(own, self.with_state, self.name_of, own.path)
            self.needs_all_files = False

    # ----------------------------------------------------------- phase 2
    def read_all_partitions(self):
        saved = self.saved
        full, frozen, self.scaler = saved.full_state(self.with_state)
        full, frozen = self._local(full), self._local(frozen)
        if self.experts_resharded and saved.reader is None:
            full = expert_checkpoint.add_local_experts(self.engine, saved.directory, full, self.with_state)
        elif self.experts_resharded:
            expert_checkpoint.localize_global_experts(self.engine, full.fp32)
            expert_checkpoint.localize_global_experts(self.engine, full.state)
        if saved.per_rank:
            self.module_values = saved.module_values(full, frozen)
        if self.has_optimizer:
            self.apply_optimizer = self.stage.prepare_import(full, self.with_state, self.name_of, saved.directory)

    # -------------------------------------------------------------- apply
    def apply_module(self):
        """Local: discard the accumulation window and load the module (may run the client's ``custom_load_fn``)."""
        engine = self.engine
        engine.zero_grad()
        if self.custom_load_fn is not None:
            self.custom_load_fn(src=self.module_values, dst=engine.module)
        else:
            # a per-rank checkpoint's names were checked (strictly, if asked) against the model in phase 1
            self.stage.import_module(engine.module, self.module_values, self.strict and not self.saved.per_rank)

    def apply(self, load_lr_scheduler_states):
        """Masters, optimizer, scaler (collective for stages 1-3), scheduler and counters."""
        engine = self.engine
        ckpt = self.saved.checkpoint
        if self.has_optimizer:
            if self.refresh_masters:
                self.stage.refresh_from_model()
            elif self.apply_optimizer is not None:
                self.apply_optimizer()
                if not self.module_only:
                    import_scaler(engine, self.scaler)
        if self.module_only:
            return
        if load_lr_scheduler_states and engine.lr_scheduler is not None and ckpt.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        engine.global_steps = int(ckpt.get("global_steps", engine.global_steps))
        engine.global_samples = int(ckpt.get("global_samples", engine.global_steps * engine.train_batch_size()))
        engine.skipped_steps = int(ckpt.get("skipped_steps", engine.skipped_steps))

    def client_state(self, load_lr_scheduler_states):
        # As upstream: an engine whose optimizer state lives in the model-states file (stage 0) and that loaded
        # optimizer states gets that file's ``optimizer`` entry back.
        gives_back = self.stage.optimizer_in_model_states and self.load_optimizer_states and not self.module_only
        return client_state_of(self.saved.checkpoint, self.load_optimizer_states, load_lr_scheduler_states,
                               self.module_only, gives_back)


def load(engine,
         load_dir,
         tag=None,
         load_module_strict=True,
         load_optimizer_states=True,
         load_lr_scheduler_states=True,
         load_module_only=False,
         custom_load_fn=None):
    """See the module docstring; returns ``(model-states path, client_state)`` or ``(None, None)``."""
    check_stage(engine, "load_checkpoint")
    if engine.checkpoint_engine.is_decoupled():  # a save still written behind training finishes first
        engine.checkpoint_engine.wait()
    group = agreement_group(engine)
    plan = _Load(engine, load_module_strict, load_optimizer_states, load_module_only, custom_load_fn)
    expert_checkpoint.check_load(engine, load_dir, tag, load_module_only, load_optimizer_states, load_module_strict)
    error = None
    try:
        plan.read(load_dir, tag)
    except Exception as exc:
        error = exc
    outcomes = agree(error, (plan.tag, plan.needs_all_files, plan.reason), group)
    tags = [tag for tag, _, _ in outcomes]
    if all(t is None for t in tags):
        logger.warning(f"load_checkpoint: nothing to load: {plan.reason}")
        return None, None
    if len(set(tags)) > 1:
        listing = ", ".join(f"rank {r}: {t!r}" + (f" ({reason})" if t is None else "")
                            for r, (t, _, reason) in enumerate(outcomes))
        raise CheckpointError(f"load_checkpoint: the ranks do not see the same checkpoint ({listing}); the "
                              f"checkpoint directory must be the same on every rank")
    if any(needs for _, needs, _ in outcomes):
        error = None
        try:
            plan.read_all_partitions()
        except Exception as exc:
            error = exc
        agree(error, None, group)
    error = None
    try:
        plan.apply_module()
    except Exception as exc:
        error = exc
    agree(error, None, group)
    plan.apply(load_lr_scheduler_states)
    expert_checkpoint.load_files(
        engine, plan.saved.directory, load_module_only, load_optimizer_states, plan.experts_resharded
        and (plan.apply_optimizer is not None or plan.saved.reader is not None))
    return plan.model_path, plan.client_state(load_lr_scheduler_states)
