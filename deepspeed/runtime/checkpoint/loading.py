# SPDX-License-Identifier: Apache-2.0
"""``load_checkpoint``: read and check everything first, agree, then change the engine.

Phase 1 (local, every rank): resolve the tag (``latest`` when None), read the
model-states file, check the module's keys and shapes against the checkpoint, and read
what the optimizer needs: for a stage 1/2 checkpoint loaded into the same layout
(same stage family, world size and buckets), only this rank's own optimizer file. The
ranks agree on the outcome (one ``all_gather_object``): nothing to load on every rank
gives ``(None, None)``; any error raises on every rank.

Phase 2 (only when some rank cannot use its own file: another world size, stage or
bucket size): every rank reads every saved rank's file and rebuilds the state by
parameter name (:mod:`reshard`), then partitions it into its own layout. The ranks
agree again.

Apply: the accumulation window is discarded and the module loaded (the ranks agree once
more: a ``custom_load_fn`` may raise); then the fp32 masters and inner optimizer state
(with the all-gather of stages 1/2), the loss scaler, the LR scheduler and the counters
are restored.

What is restored, by argument: ``load_module_only`` loads only the module (fp32 masters
are refreshed from it); otherwise the fp32 masters come from the checkpoint's fp32
values, the inner optimizer state only with ``load_optimizer_states``, the scheduler
only with ``load_lr_scheduler_states``; counters (``global_steps``, ``global_samples``,
``skipped_steps``) unless ``load_module_only``.
"""

import os

from deepspeed.runtime.checkpoint import paths, stage3_state, stage_state
from deepspeed.runtime.checkpoint.model_state import check_module, client_state_of, param_names
from deepspeed.runtime.checkpoint.reader import META_KEY, check_save_id, load_file, resolve_tag
from deepspeed.runtime.checkpoint.reshard import full_state_from_partitions, same_layout
from deepspeed.runtime.checkpoint.saving import check_stage
from deepspeed.runtime.checkpoint.validate import CheckpointError, agree, check_dir
from deepspeed.utils.logging import logger


class _Load:
    """The state of one ``load_checkpoint`` call across its phases (see the module docstring)."""

    def __init__(self, engine, load_module_strict, load_optimizer_states, load_module_only, custom_load_fn):
        self.engine = engine
        self.strict = load_module_strict and custom_load_fn is None
        self.load_optimizer_states = load_optimizer_states
        self.module_only = load_module_only
        self.custom_load_fn = custom_load_fn
        self.name_of = param_names(engine.module)
        self.tag = None
        self.reason = None
        self.model_path = None
        self.checkpoint = None
        self.scaler = None  # where the saved loss-scaler state is
        self.apply_optimizer = None
        self.refresh_masters = False
        self.needs_all_files = False
        self.saved_stage = None
        self.meta = {}
        self.load_dir = None
        self.zero3 = engine.zero_optimization_stage() == 3

    # ----------------------------------------------------------- phase 1
    def read(self, load_dir, tag):
        self.load_dir = check_dir(load_dir, "load_checkpoint")
        self.tag, self.reason = resolve_tag(self.load_dir, tag)
        if self.tag is None:
            return
        self.model_path = paths.model_states_path(self.load_dir, self.tag)
        saved_zero3 = not os.path.exists(self.model_path) and os.path.exists(
            paths.zero3_model_states_path(self.load_dir, self.tag, 0))
        if saved_zero3 != self.zero3:
            raise NotImplementedError(f"{paths.tag_dir(self.load_dir, self.tag)}: loading a checkpoint of ZeRO "
                                      f"stage {'3' if saved_zero3 else '0, 1 or 2'} into a ZeRO stage "
                                      f"{self.engine.zero_optimization_stage()} engine is not implemented")
        if self.zero3:
            self._read_zero3()
            return
        ckpt = load_file(self.model_path, "the model states")
        if not isinstance(ckpt, dict) or "module" not in ckpt:
            raise CheckpointError(f"{self.model_path}: not a model-states file (no 'module' entry)")
        self.checkpoint = ckpt
        check_module(ckpt["module"], self.engine.module, self.strict, self.model_path)
        if self.engine._stage is None:
            return
        if self.module_only:
            self.refresh_masters = True
            return
        meta = ckpt.get(META_KEY) or {}
        self.meta = meta
        has_optimizer = meta.get("has_optimizer", ckpt.get("optimizer") is not None)
        if not has_optimizer:
            if self.load_optimizer_states:
                raise CheckpointError(f"{self.model_path}: the checkpoint holds no optimizer state (it was saved by "
                                      f"an engine without an optimizer); load with load_module_only=True or "
                                      f"load_optimizer_states=False")
            self.refresh_masters = True
            return
        self.saved_stage = meta.get("zero_stage", 0 if ckpt.get("optimizer") is not None else None)
        if self.saved_stage == 0:
            self._prepare_from_stage0(ckpt)
        elif self.saved_stage in (1, 2):
            self._read_own_partition(ckpt)
        else:
            raise CheckpointError(f"{self.model_path}: the checkpoint does not say which ZeRO stage wrote it; it was "
                                  f"not written by this runtime. Load with load_module_only=True")

    def _read_zero3(self):
        """Stage 3: this rank's model-states file (rank 0's when the save had fewer ranks), own optimizer file."""
        engine = self.engine
        dp_rank = engine._stage.layout.rank
        own = paths.zero3_model_states_path(self.load_dir, self.tag, dp_rank)
        self.model_path = own if os.path.exists(own) else paths.zero3_model_states_path(self.load_dir, self.tag, 0)
        ckpt = load_file(self.model_path, "the model states")
        if not isinstance(ckpt, dict) or "module" not in ckpt:
            raise CheckpointError(f"{self.model_path}: not a model-states file (no 'module' entry)")
        self.meta = meta = ckpt.get(META_KEY) or {}
        if meta.get("zero_stage") != 3:
            raise CheckpointError(f"{self.model_path}: not a ZeRO stage 3 model-states file of this runtime")
        if self.model_path == own and dp_rank >= len(meta.get("model_files") or []):
            raise CheckpointError(f"{own}: left over from another save (the checkpoint has "
                                  f"{len(meta.get('model_files') or [])} ranks)")
        self.checkpoint = ckpt
        self.saved_stage = 3
        stage3_state.check_zero3_module(ckpt, engine.module, self.strict, self.model_path)
        if self.module_only:
            self.load_optimizer_states = False
        files = self._optim_files()
        self.needs_all_files = True
        if len(files) != engine._stage.layout.world_size:
            return
        path = files[dp_rank]
        payload = load_file(path, f"the optimizer partition of rank {dp_rank}")
        check_save_id(payload, path, meta.get("save_id"))
        saved = payload.get("optimizer_state_dict") if isinstance(payload, dict) else None
        if not isinstance(saved, dict) or stage3_state.LAYOUT3_KEY not in saved:
            raise CheckpointError(f"{path}: not a ZeRO stage 3 optimizer file of this runtime (no layout)")
        own_layout = stage3_state.describe_zero3_layout(engine._stage, self.name_of)
        if not stage3_state.same_zero3_layout(saved[stage3_state.LAYOUT3_KEY], own_layout):
            return
        self.scaler = saved
        self.apply_optimizer = stage3_state.prepare_zero3_same_layout(engine, saved, self.load_optimizer_states, path)
        self.needs_all_files = False

    def _trainable_names(self):
        return [self.name_of[p] for group in stage_state.trainable_groups(self.engine) for p in group]

    def _prepare_full(self, full, describe):
        engine = self.engine
        stage_state.check_full_state(full, stage_state.trainable_groups(engine), self.name_of, engine.basic_optimizer,
                                     self.load_optimizer_states, describe)
        if engine.zero_optimization_stage() == 0:
            return stage_state.prepare_stage0(engine, full, self.load_optimizer_states, self.name_of)
        return stage_state.prepare_partitioned_full(engine, full, self.load_optimizer_states, self.name_of, describe)

    def _prepare_from_stage0(self, ckpt):
        saved = ckpt.get("optimizer")
        full = stage_state.full_state_from_stage0(saved, ckpt["module"], self._trainable_names(), self.model_path)
        self.scaler = saved
        self.apply_optimizer = self._prepare_full(full, self.model_path)

    def _optim_files(self):
        meta = self.meta
        world = int(self.checkpoint.get("dp_world_size", 0))
        names = meta.get("optim_files") or []
        if len(names) != world:
            raise CheckpointError(f"{self.model_path}: lists {len(names)} optimizer files for a data-parallel world "
                                  f"of {world}")
        return [os.path.join(paths.tag_dir(self.load_dir, self.tag), name) for name in names]

    def _read_own_partition(self, ckpt):
        engine = self.engine
        files = self._optim_files()
        stage = engine.zero_optimization_stage()
        self.needs_all_files = True
        if stage not in (1, 2):
            return
        dp_rank = engine._stage.layout.rank
        if dp_rank >= len(files) or len(files) != engine._stage.layout.world_size:
            return
        path = files[dp_rank]
        payload = load_file(path, f"the optimizer partition of rank {dp_rank}")
        check_save_id(payload, path, self.meta.get("save_id"))
        saved = payload.get("optimizer_state_dict") if isinstance(payload, dict) else None
        if not isinstance(saved, dict) or "partition_layout" not in saved:
            raise CheckpointError(f"{path}: not an optimizer file of this runtime (no partition layout)")
        if not same_layout(saved["partition_layout"], stage_state.layout_of(engine, self.name_of)):
            return  # loadable, but only through resharding
        self.scaler = saved
        self.apply_optimizer = stage_state.prepare_partitioned_same_layout(engine, saved, self.load_optimizer_states,
                                                                           path)
        self.needs_all_files = False

    # ----------------------------------------------------------- phase 2
    def read_all_partitions(self):
        files = self._optim_files()
        payloads = []
        for rank, path in enumerate(files):
            payload = load_file(path, f"the optimizer partition of rank {rank}", mmap=True)
            check_save_id(payload, path, self.meta.get("save_id"))
            saved = payload.get("optimizer_state_dict") if isinstance(payload, dict) else None
            if not isinstance(saved, dict):
                raise CheckpointError(f"{path}: not an optimizer file (no 'optimizer_state_dict' entry)")
            payloads.append(saved)
        self.scaler = payloads[0]
        if self.saved_stage == 3:
            full, frozen = stage3_state.full_state_from_zero3(payloads, files, with_state=self.load_optimizer_states)
            self.apply_optimizer = stage3_state.prepare_zero3_full(self.engine, full, frozen,
                                                                   self.load_optimizer_states, self.name_of,
                                                                   paths.tag_dir(self.load_dir, self.tag))
            return
        full = full_state_from_partitions(payloads, files, with_state=self.load_optimizer_states)
        self.apply_optimizer = self._prepare_full(full, paths.tag_dir(self.load_dir, self.tag))

    # -------------------------------------------------------------- apply
    def apply_module(self):
        """Local: discard the accumulation window and load the module (may run the client's ``custom_load_fn``)."""
        engine = self.engine
        ckpt = self.checkpoint
        engine.zero_grad()
        if self.custom_load_fn is not None:
            self.custom_load_fn(src=ckpt["module"], dst=engine.module)
        elif self.zero3:  # the saved module holds the buffers; parameters come from the optimizer files
            engine.module.load_state_dict(ckpt["module"], strict=False)
        else:
            engine.module.load_state_dict(ckpt["module"], strict=self.strict)

    def apply(self, load_lr_scheduler_states):
        """Masters, optimizer, scaler (collective for stages 1/2: the all-gather), scheduler and counters."""
        engine = self.engine
        ckpt = self.checkpoint
        if engine._stage is not None:
            if self.refresh_masters:
                if engine.zero_optimization_stage() == 0:
                    stage_state.refresh_stage0(engine)
                else:
                    stage_state.refresh_partitioned(engine)
            elif self.apply_optimizer is not None:
                self.apply_optimizer()
                if not self.module_only:
                    stage_state.import_scaler(engine, self.scaler)
        if self.module_only:
            return
        if load_lr_scheduler_states and engine.lr_scheduler is not None and ckpt.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        engine.global_steps = int(ckpt.get("global_steps", engine.global_steps))
        engine.global_samples = int(ckpt.get("global_samples", engine.global_steps * engine.train_batch_size()))
        engine.skipped_steps = int(ckpt.get("skipped_steps", engine.skipped_steps))


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
    group = engine.data_parallel_group
    plan = _Load(engine, load_module_strict, load_optimizer_states, load_module_only, custom_load_fn)
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
    return plan.model_path, client_state_of(plan.checkpoint)
