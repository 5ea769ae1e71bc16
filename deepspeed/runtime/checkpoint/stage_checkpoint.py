# SPDX-License-Identifier: Apache-2.0
"""The interface between a ZeRO stage and the checkpoint code.

``saving.py`` and ``loading.py`` get a :class:`StageCheckpoint` from the engine's stage
(``stage.checkpoint()``, see :func:`checkpoint_of`) and call only the methods below; they
never read a stage's fields nor branch on its number. Each stage implements the interface
in its own module: ``deepspeed/runtime/zero/checkpoint/stage0.py``,
``checkpoint/partitioned.py`` (stages 1 and 2) and ``checkpoint/stage3.py``. An engine
without an optimizer has no stage; it gets :class:`ModuleOnly`.

Saving. ``checkpoint_files(save)`` lists the files this rank writes and their payloads,
in upstream's layout (names from :mod:`paths`), in the order they are written; a
model-states payload is built with :meth:`SaveContext.model_states`, an optimizer file
with :meth:`SaveContext.optimizer_file`, which add what every stage writes alike.

Loading, in two steps so that every error is found before any rank changes state:

* ``prepare_import(source, load_optimizer_states, name_of, describe)`` checks a loaded
  source against this stage and returns ``apply()``; every rank calls it once the ranks
  agreed (it may be collective). The source is an :class:`OwnPartition` (this rank's
  own optimizer file, when ``reads_own_file(saved_stage)`` and ``fits(saved, name_of)``
  say it can be used as it is) or else a
  :class:`~deepspeed.runtime.checkpoint.reshard.FullState`, matched by parameter name;
* ``import_module(module, values, strict)`` loads the values the checkpoint has for the
  module itself (full tensors by name: buffers, frozen parameters, and the trainable
  parameters where the checkpoint keeps them there), before ``apply()``;
* ``refresh_from_model()`` rebuilds the fp32 masters from the just loaded module when the
  checkpoint gives none (``load_module_only``, a checkpoint without optimizer state).
"""

from dataclasses import dataclass
from typing import Callable

import torch

from deepspeed.runtime.checkpoint.optimizer_state import (check_full_state, flat_group_state, inner_state_dict,
                                                          load_inner)
from deepspeed.runtime.checkpoint.reshard import FullState
from deepspeed.runtime.checkpoint.validate import CheckpointError


@dataclass(frozen=True)
class SaveContext:
    """What a stage needs to lay out its files for one save (built by ``saving.py``)."""
    name_of: dict  # model parameter -> name
    save_id: str
    dp_rank: int
    dp_world_size: int
    bf16: bool
    fp16: bool
    exclude_frozen_parameters: bool
    scaler: dict  # the loss-scaler entries every optimizer state carries
    ds_config: dict
    build_model_states: Callable  # (groups, meta, optimizer=None, module=None) -> dict
    mp_rank: int = 0  # this rank's tensor-parallel rank: its files are named mp_rank_{mp_rank:02d}
    complete_mark: bool = False  # the save writes the tag's completeness mark (``completeness``)

    def meta(self, zero_stage, **extra):
        """The ``ds_checkpoint_meta`` entry of a stage with an optimizer (``extra``: stage-specific keys)."""
        meta = dict(save_id=self.save_id, zero_stage=zero_stage, has_optimizer=True, bf16=self.bf16, fp16=self.fp16)
        if self.complete_mark:
            meta["complete_mark"] = True
        meta.update(extra)
        return meta

    def model_states(self, groups, meta, optimizer=None, module=None):
        """A model-states payload: ``groups`` give ``param_shapes``; ``module`` defaults to the state dict."""
        return self.build_model_states(groups, meta, optimizer=optimizer, module=module)

    def optimizer_file(self, optimizer_state_dict):
        """An optimizer-file payload around ``optimizer_state_dict`` (the scaler entries are added to it)."""
        import deepspeed
        state = dict(optimizer_state_dict)
        state.update(self.scaler)
        return dict(optimizer_state_dict=state,
                    ds_config=self.ds_config,
                    ds_version=deepspeed.__version__,
                    save_id=self.save_id)


# The optimizer-file entry of a stage's own state beside masters and optimizer (``ZeroStage.extra_state``).
STAGE_EXTRA_KEY = "stage_extra_state"


@dataclass(frozen=True)
class OwnPartition:
    """This rank's own saved optimizer state (``optimizer_state_dict`` of its file), to load as it is."""
    saved: dict
    path: str


class StageCheckpoint:
    """Base of the per-stage implementations (see the module docstring)."""

    has_optimizer = True  # False only for an engine without one (:class:`ModuleOnly`)
    # Whether the optimizer state is written into the model-states file (stage 0) rather than optimizer files.
    optimizer_in_model_states = False

    def param_groups(self):
        """Per inner param group, the trainable model parameters it steps (in the stage's order)."""
        raise NotImplementedError

    def checkpoint_files(self, save):
        """``[(file name, payload)]`` this rank writes, in order (``save``: a :class:`SaveContext`)."""
        raise NotImplementedError

    def reads_own_file(self, saved_stage):
        """Whether a checkpoint of ``saved_stage`` at this world size may hold an optimizer file this rank loads as it
        is (then :meth:`fits` decides)."""
        return False

    def fits(self, saved, name_of):
        """Whether ``saved`` (this rank's ``optimizer_state_dict``) was written in exactly this stage's layout."""
        return False

    def prepare_import(self, source, load_optimizer_states, name_of, describe):
        """Check ``source`` (:class:`OwnPartition` or ``FullState``); return ``apply()`` (see the module docstring)."""
        raise NotImplementedError

    def import_module(self, module, values, strict):
        """Load ``values`` (name -> full tensor) into ``module`` (stages 0-2: ``load_state_dict``)."""
        module.load_state_dict(values, strict=strict)

    def refresh_from_model(self):
        """The fp32 masters from the module's current values (after :meth:`import_module`)."""

    def full_16bit_value(self, param):
        """Collective: the whole value of ``param`` in the model's dtype, a fresh CPU tensor (ZeRO-3 only)."""
        raise NotImplementedError("the parameters of this stage are not partitioned; read them from the module")


class FlatMastersCheckpoint(StageCheckpoint):
    """Shared import of stages whose fp32 masters are one flat partition per param group (stages 1-3).

    Built on the stage (its ``masters``, ``layout`` with per-parameter group ``slots``, and inner ``optimizer``).
    A subclass gives ``parts_key`` (the optimizer
    file's entry of the fp32 master partitions), ``_write(param, value, out)`` (this rank's piece of ``param``'s
    full ``value`` into a group partition ``out``), ``_full_shape(param)`` and ``_refresh()`` (after the masters
    changed: put them into the model's parameters; a collective); ``_restore_extra(saved)`` may restore more of
    its own saved file.
    """

    parts_key = None

    def __init__(self, stage):
        self.stage = stage
        self.layout = stage.layout
        self.inner = stage.optimizer

    def param_groups(self):
        layout = self.layout
        return [[p for p in layout.params if layout.slots[p].group == g] for g in range(layout.num_groups)]

    def _restore_extra(self, saved):
        """What else of this rank's own saved file an ``apply()`` restores (before the refresh)."""

    def _prepare_own(self, saved, load_optimizer_states, describe):
        """Copy this rank's own saved partitions (same layout); returns ``apply()``."""
        stage = self.stage
        parts = saved[self.parts_key]
        if len(parts) != len(stage.masters):
            raise CheckpointError(f"{describe}: {len(parts)} fp32 partitions, this engine has {len(stage.masters)}")
        for g, (part, master) in enumerate(zip(parts, stage.masters)):
            if part.numel() != master.numel():
                raise CheckpointError(f"{describe}: the fp32 partition of param group {g} has {part.numel()} "
                                      f"elements, this rank's has {master.numel()}")
        inner_sd = saved["base_optimizer_state"]
        if load_optimizer_states and len(inner_sd["param_groups"]) != len(self.inner.param_groups):
            raise CheckpointError(f"{describe}: {len(inner_sd['param_groups'])} optimizer param groups, this engine's "
                                  f"optimizer has {len(self.inner.param_groups)}")

        @torch.no_grad()
        def apply():
            for part, master in zip(parts, stage.masters):
                master.data.copy_(part)
            self._restore_extra(saved)
            if load_optimizer_states:
                load_inner(self.inner, inner_sd)
            self._refresh()
            # the stage's own state beside masters and optimizer (ZenFlow's window, selection, device part)
            stage.load_extra_state(saved.get(STAGE_EXTRA_KEY) if load_optimizer_states else None)

        return apply

    def prepare_import(self, source, load_optimizer_states, name_of, describe):
        if isinstance(source, OwnPartition):
            return self._prepare_own(source.saved, load_optimizer_states, source.path)
        if not isinstance(source, FullState):
            raise CheckpointError(f"{describe}: not a checkpoint source ({type(source).__name__})")
        return self._prepare_full(source, load_optimizer_states, name_of, describe)

    def _prepare_full(self, full, load_optimizer_states, name_of, describe):
        """Cut ``full`` (a ``FullState`` matched by name) into this rank's partitions; returns ``apply()``."""
        stage = self.stage
        groups = self.param_groups()
        check_full_state(full, groups, name_of, self.inner, load_optimizer_states, describe)
        masters = [torch.zeros(m.numel(), dtype=torch.float32) for m in stage.masters]
        for g, params in enumerate(groups):
            for param in params:
                self._write(param, full.fp32[name_of[param]], masters[g])
        sd = None
        if load_optimizer_states:

            def group_state(g):
                return flat_group_state(groups[g], [self._full_shape(p) for p in groups[g]], full, name_of, g,
                                        stage.masters[g].numel(), describe, self._write)

            sd = inner_state_dict(self.inner, full, group_state)

        @torch.no_grad()
        def apply():
            for part, master in zip(masters, stage.masters):
                master.data.copy_(part)
            if sd is not None:
                load_inner(self.inner, sd)
            self._refresh()
            stage.load_extra_state(None)  # another layout: the stage's own state starts afresh

        return apply


class ModuleOnly(StageCheckpoint):
    """An engine without an optimizer: rank 0 writes the module, a load restores only the module and counters."""

    has_optimizer = False

    def __init__(self, module, zero_stage):
        self.module = module
        self.zero_stage = zero_stage

    def param_groups(self):
        return [[p for p in self.module.parameters() if p.requires_grad]]

    def checkpoint_files(self, save):
        from deepspeed.runtime.checkpoint import paths
        if save.dp_rank != 0:
            return []
        meta = dict(save.meta(self.zero_stage, optim_files=[]), has_optimizer=False)
        return [(paths.model_states_name(save.mp_rank), save.model_states(self.param_groups(), meta))]


def checkpoint_of(engine):
    """The :class:`StageCheckpoint` of ``engine``: its stage's, or :class:`ModuleOnly` without an optimizer."""
    if engine._stage is None:
        return ModuleOnly(engine.module, engine.zero_optimization_stage())
    return engine._stage.checkpoint()
