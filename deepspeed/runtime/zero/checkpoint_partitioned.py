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
from deepspeed.runtime.checkpoint.optimizer_state import (check_full_state, flat_group_state, inner_state_dict,
                                                          load_inner)
from deepspeed.runtime.checkpoint.reshard import LAYOUT_KEY, FullState, same_layout
from deepspeed.runtime.checkpoint.stage_checkpoint import OwnPartition, StageCheckpoint
from deepspeed.runtime.checkpoint.validate import CheckpointError


def describe_layout(layout, name_of):
    """The metadata of a :class:`PartitionedLayout` that resharding needs (plain Python types, rank included)."""
    params = []
    for param in layout.params:
        slot = layout.slots[param]
        params.append(
            dict(name=name_of[param], shape=list(slot.shape), group=slot.group, offset=slot.offset, numel=slot.numel))
    buckets = [
        dict(group=b.group, start=b.start, numel=b.numel, padded=b.padded, chunk=b.chunk, part_offset=b.part_offset)
        for b in layout.buckets
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


class PartitionedCheckpoint(StageCheckpoint):
    """Checkpoint export and import of a :class:`~deepspeed.runtime.zero.stage_1_and_2.PartitionedStage`."""

    def __init__(self, stage):
        self.stage = stage
        self.layout = stage.layout
        self.inner = stage.optimizer

    def param_groups(self):
        layout = self.layout
        return [[p for p in layout.params if layout.slots[p].group == g] for g in range(layout.num_groups)]

    # ---------------------------------------------------------------- export
    def checkpoint_files(self, save):
        stage = self.stage
        import deepspeed
        files = []
        if save.dp_rank == 0:
            meta = save.meta(stage.stage,
                             optim_files=[paths.optim_states_name(r, save.bf16) for r in range(save.dp_world_size)])
            files.append((paths.MODEL_STATES_FILE, save.model_states(self.param_groups(), meta)))
        state = dict(zero_stage=stage.stage,
                     base_optimizer_state=self.inner.state_dict(),
                     single_partition_of_fp32_groups=[m.detach() for m in stage.masters],
                     partition_count=self.layout.world_size,
                     partition_layout=describe_layout(self.layout, save.name_of),
                     ds_version=deepspeed.__version__)
        files.append((paths.optim_states_name(self.layout.rank, save.bf16), save.optimizer_file(state)))
        return files

    # ---------------------------------------------------------------- import
    def reads_own_file(self, saved_stage):
        return saved_stage in (1, 2)

    def fits(self, saved, name_of):
        return LAYOUT_KEY in saved and same_layout(saved[LAYOUT_KEY], describe_layout(self.layout, name_of))

    def prepare_import(self, source, load_optimizer_states, name_of, describe):
        if isinstance(source, OwnPartition):
            return self._prepare_own(source.saved, load_optimizer_states, source.path)
        if not isinstance(source, FullState):
            raise CheckpointError(f"{describe}: not a checkpoint source ({type(source).__name__})")
        return self._prepare_full(source, load_optimizer_states, name_of, describe)

    def _prepare_own(self, saved, load_optimizer_states, describe):
        stage = self.stage
        parts = saved["single_partition_of_fp32_groups"]
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
            if load_optimizer_states:
                load_inner(self.inner, inner_sd)
            stage.all_gather_params()

        return apply

    def _prepare_full(self, full, load_optimizer_states, name_of, describe):
        stage = self.stage
        layout = self.layout
        groups = self.param_groups()
        check_full_state(full, groups, name_of, self.inner, load_optimizer_states, describe)
        masters = []
        for g, master in enumerate(stage.masters):
            part = torch.zeros(master.numel(), dtype=torch.float32)
            fill_partition(layout, groups[g], {p: full.fp32[name_of[p]] for p in groups[g]}, part)
            masters.append(part)
        sd = None
        if load_optimizer_states:

            def group_state(g):
                return flat_group_state(groups[g], [p.shape for p in groups[g]], full, name_of, g,
                                        stage.masters[g].numel(), describe,
                                        lambda param, value, out: write_owned(layout, param, value, out))

            sd = inner_state_dict(self.inner, full, group_state)

        @torch.no_grad()
        def apply():
            for part, master in zip(masters, stage.masters):
                master.data.copy_(part)
            if sd is not None:
                load_inner(self.inner, sd)
            stage.all_gather_params()

        return apply

    @torch.no_grad()
    def refresh_from_model(self):
        stage = self.stage
        layout = self.layout
        for bucket in layout.buckets:
            master = stage.masters[bucket.group].data
            layout.bucket_part(master, bucket).copy_(layout.bucket_own_chunk_full(stage.flat_params, bucket))
