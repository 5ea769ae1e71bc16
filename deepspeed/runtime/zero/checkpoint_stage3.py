# SPDX-License-Identifier: Apache-2.0
"""ZeRO stage 3: checkpoint export and import (the interface of ``runtime/checkpoint/stage_checkpoint.py``).

Every rank writes ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` (the module entry holds
only the persistent buffers: parameters are never whole; ``ds_checkpoint_meta`` also lists
``model_files`` and ``state_dict_keys``) and its optimizer file: ``zero_stage`` 3,
``fp32_flat_groups`` (the rank's fp32 master partition per param group),
``base_optimizer_state``, ``frozen_16bit_shards`` (the rank's 16-bit shards of the frozen
parameters; None with ``exclude_frozen_parameters``), ``partition_count``, the loss-scaler
entries and ``zero3_layout`` (:func:`describe_zero3_layout`).

Import. From the same layout each rank copies its own partitions; from anything else a
``FullState`` matched by name is cut into this rank's shards. The module's own values
(buffers, frozen parameters, and the parameters of a checkpoint of stages 0-2) are
written by :meth:`Stage3Checkpoint.import_module`: buffers by ``load_state_dict``,
parameters into their shards (and fp32 masters). ``apply()`` ends by refreshing the
16-bit shards from the masters and gathering the persistent parameters again, so every
rank calls it.
"""

import torch

from deepspeed.runtime.checkpoint import paths
from deepspeed.runtime.checkpoint.model_state import buffer_names, persistent_buffers
from deepspeed.runtime.checkpoint.optimizer_state import (check_full_state, flat_group_state, inner_state_dict,
                                                          load_inner)
from deepspeed.runtime.checkpoint.reshard import FullState
from deepspeed.runtime.checkpoint.stage3_state import LAYOUT3_KEY, same_zero3_layout
from deepspeed.runtime.checkpoint.stage_checkpoint import OwnPartition, StageCheckpoint
from deepspeed.runtime.checkpoint.validate import CheckpointError
from deepspeed.runtime.zero.partition_parameters import write_shard_from_full


def describe_zero3_layout(stage, name_of):
    """Plain-Python description of a stage-3 layout (rank included): what resharding needs."""
    layout = stage.layout
    params = []
    for param in stage.module.parameters():
        slot = layout.slots[param]
        params.append(
            dict(name=name_of[param],
                 shape=list(param.ds_shape),
                 numel=int(param.ds_numel),
                 shard=slot.shard,
                 group=slot.group,
                 part_offset=slot.part_offset))
    return dict(world_size=layout.world_size,
                rank=layout.rank,
                num_groups=layout.num_groups,
                group_part_numel=list(layout.group_part_numel),
                frozen_part_numel=layout.frozen_part_numel,
                params=params)


def write_shard(layout, param, value, out):
    """Write this rank's shard of the full ``value`` of ``param`` into ``out`` (a group partition); padding 0."""
    slot = layout.slots[param]
    start = layout.rank * slot.shard
    take = max(0, min(param.ds_numel - start, slot.shard))
    target = out.narrow(0, slot.part_offset, slot.shard)
    target.zero_()
    if take > 0:
        target[:take].copy_(value.reshape(-1)[start:start + take].to(out.dtype))


class Stage3Checkpoint(StageCheckpoint):
    """Checkpoint export and import of a :class:`~deepspeed.runtime.zero.stage3.Stage3`."""

    def __init__(self, stage):
        self.stage = stage
        self.layout = stage.layout
        self.inner = stage.optimizer

    def param_groups(self):
        layout = self.layout
        return [[p for p in layout.params if layout.slots[p].group == g] for g in range(layout.num_groups)]

    def _frozen_part(self):
        return self.stage.sources[len(self.stage.masters)]

    # ---------------------------------------------------------------- export
    def checkpoint_files(self, save):
        stage = self.stage
        module = stage.module
        world = save.dp_world_size
        meta = save.meta(3,
                         optim_files=[paths.optim_states_name(r, save.bf16) for r in range(world)],
                         model_files=[paths.ZERO3_MODEL_STATES_FILE.format(rank=r) for r in range(world)],
                         state_dict_keys=list(module.state_dict().keys()))
        states = save.model_states(self.param_groups(), meta, module=persistent_buffers(module))
        frozen = None
        if not save.exclude_frozen_parameters and self.layout.frozen_part_numel:
            frozen = self._frozen_part().detach().cpu().clone()
        state = dict(zero_stage=3,
                     base_optimizer_state=self.inner.state_dict(),
                     fp32_flat_groups=[m.detach() for m in stage.masters],
                     frozen_16bit_shards=frozen,
                     partition_count=self.layout.world_size)
        state[LAYOUT3_KEY] = describe_zero3_layout(stage, save.name_of)
        rank = self.layout.rank
        return [(paths.ZERO3_MODEL_STATES_FILE.format(rank=rank), states),
                (paths.optim_states_name(rank, save.bf16), save.optimizer_file(state))]

    @torch.no_grad()
    def full_16bit_value(self, param):
        stage = self.stage
        source = stage.sources[self.layout.slots[param].group]  # fp32 masters or 16-bit shards
        full = stage._gather(self.layout.shard_view(source, param), param)
        return full.to(stage.model_dtype).cpu().clone()

    # ---------------------------------------------------------------- import
    def reads_own_file(self, saved_stage):
        return saved_stage == 3

    def fits(self, saved, name_of):
        return LAYOUT3_KEY in saved and same_zero3_layout(saved[LAYOUT3_KEY], describe_zero3_layout(
            self.stage, name_of))

    def prepare_import(self, source, load_optimizer_states, name_of, describe):
        if isinstance(source, OwnPartition):
            return self._prepare_own(source.saved, load_optimizer_states, source.path)
        if not isinstance(source, FullState):
            raise CheckpointError(f"{describe}: not a checkpoint source ({type(source).__name__})")
        return self._prepare_full(source, load_optimizer_states, name_of, describe)

    def _prepare_own(self, saved, load_optimizer_states, describe):
        stage = self.stage
        parts = saved["fp32_flat_groups"]
        if len(parts) != len(stage.masters):
            raise CheckpointError(f"{describe}: {len(parts)} fp32 partitions, this engine has {len(stage.masters)}")
        inner_sd = saved["base_optimizer_state"]
        if load_optimizer_states and len(inner_sd["param_groups"]) != len(self.inner.param_groups):
            raise CheckpointError(f"{describe}: {len(inner_sd['param_groups'])} optimizer param groups, this engine's "
                                  f"optimizer has {len(self.inner.param_groups)}")
        frozen = saved.get("frozen_16bit_shards")

        @torch.no_grad()
        def apply():
            for part, master in zip(parts, stage.masters):
                master.data.copy_(part)
            if frozen is not None:
                self._frozen_part().copy_(frozen)
            if load_optimizer_states:
                load_inner(self.inner, inner_sd)
            stage.refresh_16bit()

        return apply

    def _prepare_full(self, full, load_optimizer_states, name_of, describe):
        stage = self.stage
        layout = self.layout
        groups = self.param_groups()
        check_full_state(full, groups, name_of, self.inner, load_optimizer_states, describe)
        masters = [torch.zeros(m.numel(), dtype=torch.float32) for m in stage.masters]
        for g, params in enumerate(groups):
            for param in params:
                write_shard(layout, param, full.fp32[name_of[param]], masters[g])
        sd = None
        if load_optimizer_states:

            def group_state(g):
                return flat_group_state(groups[g], [p.ds_shape for p in groups[g]], full, name_of, g,
                                        stage.masters[g].numel(), describe,
                                        lambda param, value, out: write_shard(layout, param, value, out))

            sd = inner_state_dict(self.inner, full, group_state)

        @torch.no_grad()
        def apply():
            for part, master in zip(masters, stage.masters):
                master.data.copy_(part)
            if sd is not None:
                load_inner(self.inner, sd)
            stage.refresh_16bit()

        return apply

    @torch.no_grad()
    def import_module(self, module, values, strict):
        """Buffers by ``load_state_dict``; each parameter with a value into its shard (and fp32 master).

        ``strict`` is not used: the names were checked against the model before (a
        partitioned module's ``load_state_dict`` cannot take whole parameters).
        """
        buffers = set(buffer_names(module))
        module.load_state_dict({name: value for name, value in values.items() if name in buffers}, strict=False)
        stage = self.stage
        for name, param in module.named_parameters():
            value = values.get(name)
            if value is None:
                continue
            write_shard_from_full(param, value)
            stage.params_modified(param)
        stage.refresh_16bit()

    def refresh_from_model(self):
        """Nothing left to do: :meth:`import_module` wrote the parameters into their fp32 masters."""
