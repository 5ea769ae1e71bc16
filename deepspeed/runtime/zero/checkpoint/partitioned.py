# SPDX-License-Identifier: Apache-2.0
"""ZeRO stages 1 and 2: checkpoint export and import (the interface of ``runtime/checkpoint/stage_checkpoint.py``).

Rank 0 writes the model-states file (``optimizer`` None); every rank writes its optimizer
file, whose ``optimizer_state_dict`` holds ``zero_stage``, ``single_partition_of_fp32_groups``
(the rank's fp32 master partition per param group), ``base_optimizer_state`` (the torch
optimizer's state dict over those partitions), ``partition_count``, the loss-scaler
entries and ``partition_layout`` (:func:`describe_layout`: what resharding needs).

Import. From the same layout (stage 1 or 2, same world size and buckets) each rank copies
its own partition; from anything else, a ``FullState`` matched by name is cut into this
rank's partition (:func:`fill_partition`). Either ends with the all-gather that puts the
masters into the model's parameters, so every rank calls ``apply()``.
"""

import torch

from deepspeed.runtime.checkpoint import paths
from deepspeed.runtime.checkpoint.reshard import LAYOUT_KEY, same_layout
from deepspeed.runtime.checkpoint.stage_checkpoint import STAGE_EXTRA_KEY, FlatMastersCheckpoint
from deepspeed.utils.groups import EXPERT_GROUP_PREFIX


def describe_layout(layout, name_of):
    """The metadata of a :class:`PartitionedLayout` that resharding needs (plain Python types, rank included)."""
    params = []
    for param in layout.params:
        slot = layout.slots[param]
        params.append(
            dict(name=name_of[param], shape=list(slot.shape), group=slot.group, offset=slot.offset, numel=slot.numel))
    # an expert bucket (ep > 1) holds other experts on other expert-parallel ranks under the same names: resharding
    # reads its values from the expert states files instead (runtime/checkpoint/expert.py)
    buckets = [
        dict(group=b.group,
             start=b.start,
             numel=b.numel,
             padded=b.padded,
             chunk=b.chunk,
             part_offset=b.part_offset,
             expert=bool(b.spec is not None and b.spec.name.startswith(EXPERT_GROUP_PREFIX)
                         and b.world != layout.world_size)) for b in layout.buckets
    ]
    return dict(world_size=layout.world_size,
                rank=layout.rank,
                numel=layout.numel,
                group_part_numel=list(layout.group_part_numel),
                params=params,
                buckets=buckets)


def fill_partition(layout, params, values, out):
    """Write into ``out`` (one group's partition on this rank) this rank's pieces of ``values[param]``."""
    for param in params:
        write_owned(layout, param, values[param], out)


def write_owned(layout, param, value, out):
    """Write this rank's pieces of ``param``'s full ``value`` into ``out`` (its group's partition)."""
    owned = layout.owned_ranges(param)
    if owned is not None:
        start, length, offset = owned
        out.narrow(0, offset, length).copy_(value.reshape(-1).narrow(0, start, length))


class PartitionedCheckpoint(FlatMastersCheckpoint):
    """Checkpoint export and import of a :class:`~deepspeed.runtime.zero.stage_1_and_2.PartitionedStage`."""

    parts_key = "single_partition_of_fp32_groups"

    # ---------------------------------------------------------------- export
    def checkpoint_files(self, save):
        stage = self.stage
        import deepspeed
        files = []
        if save.dp_rank == 0:
            meta = save.meta(
                stage.stage,
                optim_files=[paths.optim_states_name(r, save.bf16, save.mp_rank) for r in range(save.dp_world_size)])
            files.append((paths.model_states_name(save.mp_rank), save.model_states(self.param_groups(), meta)))
        state = dict(zero_stage=stage.stage,
                     base_optimizer_state=self.inner.state_dict(),
                     single_partition_of_fp32_groups=[m.detach() for m in stage.masters],
                     partition_count=self.layout.world_size,
                     partition_layout=describe_layout(self.layout, save.name_of),
                     ds_version=deepspeed.__version__)
        extra = stage.extra_state()  # ZenFlow's window, selection and device part
        if extra is not None:
            state[STAGE_EXTRA_KEY] = extra
        files.append((paths.optim_states_name(self.layout.rank, save.bf16, save.mp_rank), save.optimizer_file(state)))
        return files

    # ---------------------------------------------------------------- import
    def reads_own_file(self, saved_stage):
        return saved_stage in (1, 2)

    def fits(self, saved, name_of):
        return LAYOUT_KEY in saved and same_layout(saved[LAYOUT_KEY], describe_layout(self.layout, name_of))

    def _write(self, param, value, out):
        write_owned(self.layout, param, value, out)

    @staticmethod
    def _full_shape(param):
        return param.shape

    def _refresh(self):
        self.stage.all_gather_params()

    @torch.no_grad()
    def refresh_from_model(self):
        stage = self.stage
        layout = self.layout
        for bucket in layout.buckets:
            master = stage.masters[bucket.group].data
            layout.bucket_part(master, bucket).copy_(layout.bucket_own_chunk_full(stage.flat_params, bucket))
