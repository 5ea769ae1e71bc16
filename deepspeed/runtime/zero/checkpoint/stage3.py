# SPDX-License-Identifier: Apache-2.0
"""ZeRO stage 3: checkpoint export and import (the interface of ``runtime/checkpoint/stage_checkpoint.py``).

Every rank writes ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` (the module entry holds
only the persistent buffers: parameters are never whole; ``ds_checkpoint_meta`` also lists
``model_files`` and ``state_dict_keys``) and its optimizer file: ``zero_stage`` 3,
``fp32_flat_groups`` (the rank's fp32 master partition per param group),
``base_optimizer_state``, ``frozen_16bit_shards`` (the rank's 16-bit shards of the frozen
parameters, dequantized when ZeRO++ stores them quantized, whose int8 codes and scales are then also in
``frozen_quantized_shards``; None with ``exclude_frozen_parameters``), ``partition_count``, the loss-scaler
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
from deepspeed.runtime.checkpoint.stage3_state import LAYOUT3_KEY, same_zero3_layout
from deepspeed.runtime.checkpoint.stage_checkpoint import STAGE_EXTRA_KEY, FlatMastersCheckpoint
from deepspeed.runtime.zero.units.frozen_quant import load_packed_state, packed_state
from deepspeed.runtime.zero.partition_parameters import write_shard_from_full


def describe_zero3_layout(stage, name_of):
    """Plain-Python description of a stage-3 layout (rank included): what resharding needs. A parameter sharded
    over its expert-data-parallel group (an expert of expert-parallel size > 1) is marked ``expert``."""
    layout = stage.layout
    params = []
    for param in stage.module.parameters():
        slot = layout.slots[param]
        entry = dict(name=name_of[param],
                     shape=list(param.ds_shape),
                     numel=int(param.ds_numel),
                     shard=slot.shard,
                     group=slot.group,
                     part_offset=slot.part_offset)
        if param in stage._expert_specs:  # sharded over its expert-data-parallel group; differs by ep rank
            entry["expert"] = True
        params.append(entry)
    return dict(world_size=layout.world_size,
                rank=layout.rank,
                num_groups=layout.num_groups,
                group_part_numel=list(layout.group_part_numel),
                frozen_part_numel=layout.frozen_part_numel,
                params=params)


def write_shard(layout, param, value, out):
    """Write this rank's shard of the full ``value`` of ``param`` into ``out`` (a group partition); padding 0."""
    slot = layout.slots[param]
    start = slot.rank * slot.shard
    take = max(0, min(param.ds_numel - start, slot.shard))
    target = out.narrow(0, slot.part_offset, slot.shard)
    target.zero_()
    if take > 0:
        target[:take].copy_(value.reshape(-1)[start:start + take].to(out.dtype))


class Stage3Checkpoint(FlatMastersCheckpoint):
    """Checkpoint export and import of a :class:`~deepspeed.runtime.zero.stage3.Stage3`."""

    parts_key = "fp32_flat_groups"

    def _frozen_part(self):
        return self.stage.frozen_partition()

    # ---------------------------------------------------------------- export
    def checkpoint_files(self, save):
        stage = self.stage
        module = stage.module
        world = save.dp_world_size
        meta = save.meta(3,
                         optim_files=[paths.optim_states_name(r, save.bf16, save.mp_rank) for r in range(world)],
                         model_files=[paths.zero3_model_states_name(r, save.mp_rank) for r in range(world)],
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
        if frozen is not None and stage.frozen_store is not None:  # ZeRO++ quantized frozen weights, exactly
            state["frozen_quantized_shards"] = packed_state(stage.frozen_store)
        state[LAYOUT3_KEY] = describe_zero3_layout(stage, save.name_of)
        extra = stage.extra_state()  # ZenFlow's window, selection and device part
        if extra is not None:
            state[STAGE_EXTRA_KEY] = extra
        rank = self.layout.rank
        return [(paths.zero3_model_states_name(rank, save.mp_rank), states),
                (paths.optim_states_name(rank, save.bf16, save.mp_rank), save.optimizer_file(state))]

    @torch.no_grad()
    def full_16bit_value(self, param):
        stage = self.stage
        full = stage._gather(stage.shard_16bit(param), param)  # fp32 masters or 16-bit shards
        return full.to(stage.model_dtype).cpu().clone()

    # ---------------------------------------------------------------- import
    def reads_own_file(self, saved_stage):
        return saved_stage == 3

    def fits(self, saved, name_of):
        return LAYOUT3_KEY in saved and same_zero3_layout(saved[LAYOUT3_KEY], describe_zero3_layout(
            self.stage, name_of))

    def _restore_extra(self, saved):
        frozen = saved.get("frozen_16bit_shards")
        packed = saved.get("frozen_quantized_shards")
        if packed is not None and self.stage.frozen_store is not None:
            load_packed_state(self.stage.frozen_store, packed)
        elif frozen is not None:
            self.stage.load_frozen_partition(frozen)

    def _write(self, param, value, out):
        write_shard(self.layout, param, value, out)

    @staticmethod
    def _full_shape(param):
        return param.ds_shape

    def _refresh(self):
        self.stage.refresh_16bit()

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
