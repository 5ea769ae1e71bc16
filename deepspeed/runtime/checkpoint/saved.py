# SPDX-License-Identifier: Apache-2.0
"""A saved checkpoint tag, read without knowing which stage will load it.

This runtime writes two layouts (docs/checkpoints.md):

* *replicated module* (stages 0, 1, 2): rank 0's ``mp_rank_00_model_states.pt`` holds the
  whole module; a stage-0 checkpoint keeps its optimizer state there too, a stage 1/2
  checkpoint in one optimizer file per rank;
* *per-rank* (stage 3): each rank's ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` holds
  only the buffers; every parameter, trainable or frozen, lives in the optimizer files.

A checkpoint written by upstream DeepSpeed has the same file names; its model-states file
lacks this package's ``ds_checkpoint_meta``, and its state is read by
:class:`~deepspeed.checkpoint.upstream_format.UpstreamCheckpoint` (always as a ``FullState``); a
universal folder (``checkpoint.load_universal``) by
:class:`~deepspeed.checkpoint.universal_checkpoint.UniversalCheckpoint`.

:class:`SavedCheckpoint` reads the model-states file this rank needs and offers what a
load of any stage asks for: the saved shapes of the module's entries (to check the
model), this rank's own optimizer state (:meth:`own_partition`), the
:class:`~deepspeed.runtime.checkpoint.reshard.FullState` of every trainable parameter
(:meth:`full_state`) and the full values of the module's own entries
(:meth:`module_values`). Every problem raises :class:`CheckpointError` naming the file.
"""

import os

import torch

from deepspeed.checkpoint.universal_checkpoint import UniversalCheckpoint
from deepspeed.checkpoint.upstream_format import UpstreamCheckpoint, is_upstream_model_states
from deepspeed.runtime.checkpoint import paths
from deepspeed.runtime.checkpoint.reader import META_KEY, check_save_id, load_file
from deepspeed.runtime.checkpoint.reshard import FullState, full_state_from_partitions
from deepspeed.runtime.checkpoint.stage3_state import full_state_from_zero3
from deepspeed.runtime.checkpoint.stage_checkpoint import OwnPartition
from deepspeed.runtime.checkpoint.validate import CheckpointError


class SavedCheckpoint:
    """The checkpoint under ``<load_dir>/<tag>`` as data-parallel rank ``dp_rank`` reads it."""

    def __init__(self, load_dir, tag, dp_rank, universal=False, mp_rank=0, mp_size=1):
        self.directory = paths.tag_dir(load_dir, tag)
        # Tensor parallelism: each tensor-parallel rank reads its own files (mp_rank_{t:02d}); whole tensors (a
        # universal folder, a checkpoint saved without tensor parallelism) are read from rank 0's files.
        if universal or not (os.path.exists(paths.model_states_path(load_dir, tag, mp_rank))
                             or os.path.exists(paths.zero3_model_states_path(load_dir, tag, 0, mp_rank))):
            mp_rank = 0
        replicated = paths.model_states_path(load_dir, tag, mp_rank)
        rank0 = paths.zero3_model_states_path(load_dir, tag, 0, mp_rank)
        self.per_rank = not os.path.exists(replicated) and os.path.exists(rank0)
        own = paths.zero3_model_states_path(load_dir, tag, dp_rank, mp_rank)
        if self.per_rank:
            # a rank the save did not have reads rank 0's file: the buffers are the same on every rank
            self.model_path = own if os.path.exists(own) else rank0
        else:
            self.model_path = replicated
        ckpt = load_file(self.model_path, "the model states")
        if not isinstance(ckpt, dict) or "module" not in ckpt:
            raise CheckpointError(f"{self.model_path}: not a model-states file (no 'module' entry)")
        self.checkpoint = ckpt
        self.meta = meta = ckpt.get(META_KEY) or {}
        # a checkpoint in another format (a universal folder, or upstream DeepSpeed's): read by its format's reader
        saved_tp = int(ckpt.get("tensor_parallel_size") or 1)
        if universal:
            self.reader = UniversalCheckpoint(self.directory, ckpt, self.model_path)
        elif mp_size is not None and saved_tp > 1 and saved_tp != mp_size:  # another tensor-parallel size: merged
            from deepspeed.runtime.tensor_parallel.checkpoint import MergedTensorParallel
            self.reader = MergedTensorParallel(load_dir, tag)
            self.checkpoint = ckpt = self.reader.checkpoint
            self.per_rank = False
        elif is_upstream_model_states(ckpt):
            self.reader = UpstreamCheckpoint(self.directory, ckpt, self.model_path)
        else:
            self.reader = None
        if self.reader is not None:
            if self.per_rank and self.model_path == own and dp_rank >= self.reader.world_size:
                raise CheckpointError(f"{own}: left over from another save (the checkpoint has "
                                      f"{self.reader.world_size} ranks)")
        elif self.per_rank:
            if meta.get("zero_stage") != 3:
                raise CheckpointError(f"{self.model_path}: not a ZeRO stage 3 model-states file of this runtime")
            saved_ranks = len(meta.get("model_files") or [])
            if self.model_path == own and dp_rank >= saved_ranks:
                raise CheckpointError(f"{own}: left over from another save (the checkpoint has {saved_ranks} ranks)")

    # ------------------------------------------------------------ what it is
    @property
    def saved_stage(self):
        """The ZeRO stage that wrote the checkpoint (None when the file does not say)."""
        if self.reader is not None:
            return self.reader.stage
        if self.per_rank:
            return 3
        return self.meta.get("zero_stage", 0 if self.checkpoint.get("optimizer") is not None else None)

    @property
    def has_optimizer(self):
        if self.reader is not None:
            return self.reader.has_optimizer
        return self.per_rank or bool(self.meta.get("has_optimizer", self.checkpoint.get("optimizer") is not None))

    @property
    def world_size(self):
        return int(self.checkpoint.get("dp_world_size", 0))

    def optim_files(self):
        """The paths of every saved rank's optimizer file (index = rank)."""
        if self.reader is not None:
            return self.reader.optim_files()
        names = self.meta.get("optim_files") or []
        if len(names) != self.world_size:
            raise CheckpointError(f"{self.model_path}: lists {len(names)} optimizer files for a data-parallel world "
                                  f"of {self.world_size}")
        return [os.path.join(self.directory, name) for name in names]

    def saved_shapes(self):
        """``{name: shape}`` of every entry the checkpoint has for the module (parameters by every tied name)."""
        shapes = self.reader.module_shapes() if hasattr(self.reader, "module_shapes") else None
        if shapes is not None:  # a format whose names differ from its module's (upstream's AutoEP)
            return shapes
        ckpt = self.checkpoint
        module = ckpt["module"]
        if not isinstance(module, dict):
            raise CheckpointError(f"{self.model_path}: 'module' is not a state dict")
        shapes = {name: tuple(t.shape) for name, t in module.items() if torch.is_tensor(t)}
        if self.per_rank:
            for group in ckpt.get("param_shapes") or []:
                shapes.update((name, tuple(shape)) for name, shape in group.items())
            shapes.update((name, tuple(shape)) for name, shape in (ckpt.get("frozen_param_shapes") or {}).items())
            for alias, name in (ckpt.get("shared_params") or {}).items():
                if name in shapes:
                    shapes[alias] = shapes[name]
        return shapes

    # ------------------------------------------------------------- its state
    def _read_optimizer_file(self, path, rank, mmap=False):
        payload = load_file(path, f"the optimizer partition of rank {rank}", mmap=mmap)
        check_save_id(payload, path, self.meta.get("save_id"))
        saved = payload.get("optimizer_state_dict") if isinstance(payload, dict) else None
        if not isinstance(saved, dict):
            raise CheckpointError(f"{path}: not an optimizer file (no 'optimizer_state_dict' entry)")
        return saved

    def own_partition(self, dp_rank):
        """Rank ``dp_rank``'s saved optimizer state, as an :class:`OwnPartition` (the save had that rank)."""
        path = self.optim_files()[dp_rank]
        return OwnPartition(saved=self._read_optimizer_file(path, dp_rank), path=path)

    def stage0_full_state(self, trainable_names):
        """A FullState from a stage-0 ``optimizer`` entry (and the saved module, for fp32 models)."""
        if self.reader is not None:
            full, _, scaler = self.reader.full_state(True, trainable_names)
            return full, scaler
        saved = self.checkpoint.get("optimizer")
        if not isinstance(saved, dict) or "param_names" not in saved or "optimizer" not in saved:
            raise CheckpointError(f"{self.model_path}: the 'optimizer' entry was not written by this runtime's ZeRO "
                                  f"stage 0; load with load_module_only=True (or load_optimizer_states=False)")
        inner_sd = saved["optimizer"]
        flat = [name for group in saved["param_names"] for name in group]
        state = {}
        for index, st in inner_sd["state"].items():
            if index >= len(flat) or flat[index] is None:
                raise CheckpointError(f"{self.model_path}: optimizer state for parameter index {index}, which has "
                                      f"no name")
            state[flat[index]] = st
        masters = saved.get("fp32_master_weights")
        module = self.checkpoint["module"]
        fp32 = {}
        for name in trainable_names:
            value = masters.get(name) if masters is not None else module.get(name)
            if value is not None:
                fp32[name] = value.float() if value.dtype != torch.float32 else value
        groups = [{k: v for k, v in group.items() if k != "params"} for group in inner_sd["param_groups"]]
        return FullState(fp32=fp32, state=state, groups=groups, group_names=saved["param_names"]), saved

    def full_state(self, with_state):
        """``(FullState, frozen, scaler)`` from every saved rank's optimizer file (stages 1-3).

        ``frozen``: name -> full 16-bit value of each frozen parameter a stage-3 checkpoint
        holds (empty otherwise); ``scaler``: the payload the loss-scaler entries are read from.
        """
        if self.reader is not None:
            return self.reader.full_state(with_state)
        files = self.optim_files()
        payloads = [self._read_optimizer_file(path, rank, mmap=True) for rank, path in enumerate(files)]
        if self.per_rank:
            full, frozen = full_state_from_zero3(payloads, files, with_state=with_state)
        else:
            full, frozen = full_state_from_partitions(payloads, files, with_state=with_state), {}
        return full, frozen, payloads[0]

    def module_values(self, full=None, frozen=None):
        """name -> full value of every entry the checkpoint has for the module.

        Replicated module: the saved ``module``. Per-rank: the buffers, and with ``full``
        (and ``frozen``) from :meth:`full_state` every parameter (trainable ones as their
        fp32 value) under each of its tied names.
        """
        values = dict(self.checkpoint["module"]) if self.reader is None else self.reader.module_values()
        if not self.per_rank or full is None:
            return values
        values.update(frozen or {})
        values.update(full.fp32)
        for alias, name in (self.checkpoint.get("shared_params") or {}).items():
            if name in values:
                values[alias] = values[name]
        return values
