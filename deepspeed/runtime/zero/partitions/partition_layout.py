# SPDX-License-Identifier: Apache-2.0
"""Flat, rank-divisible layout of parameters for ZeRO stages 1 and 2.

Parameters are laid out in reverse registration order (about the order backward
produces their gradients) in one flat *full* space, cut into buckets of about
``bucket_numel`` elements. A bucket holds parameters of one optimizer param group
only, and is padded to a multiple of the data-parallel world size ``W``; rank ``r``
owns chunk ``r`` of every bucket (``chunk = padded / W`` elements), so a bucket's
reduce-scatter and all-gather are plain equal-chunk collectives.

Each param group has its own *partition space* on each rank: the concatenation of
the rank's chunks of that group's buckets. It is the shape of the rank's fp32
master partition, of its optimizer state and of its gradient partition.

Parameters may be reduced over a process group of their own (expert parameters: their
expert-data-parallel group; ``spec_of`` gives each parameter's ReductionSpec): a bucket then
holds parameters of one spec only, is padded to a multiple of that group's size and chunked
over it, and the rank's chunk is the one of its rank in that group. A param group mixing dense
and expert parameters is fine: its partition concatenates chunks of either kind.

A parameter may straddle chunks (and so ranks); zero-sized parameters take no
space; padding elements are never read as gradients (they stay zero).

:class:`UnitPartitionLayout` is the stage-3 counterpart: there every parameter is
sharded on its own (``ds_shard_numel`` elements per rank) and a rank's partition of
param group ``g`` is the concatenation, in unit order, of its shards of that group's
parameters.
"""

from dataclasses import dataclass, field

import torch


@dataclass
class PartitionBucket:
    index: int
    group: int
    start: int  # offset in the full space
    numel: int  # elements holding parameters
    padded: int  # numel rounded up to a multiple of the world size
    part_offset: int  # offset of this rank's chunk in the group's partition space
    chunk: int = 0  # padded / world size: what each rank owns
    params: list = field(default_factory=list)
    world: int = 1  # the size of the group this bucket is partitioned over
    rank: int = 0  # this rank's index in that group
    spec: object = None  # the ReductionSpec of its parameters (None: the layout's world and rank)


@dataclass
class PartitionSlot:
    offset: int  # in the full space
    numel: int
    shape: torch.Size
    bucket: int
    group: int


class PartitionedLayout:
    """See the module docstring. ``groups`` is a list of lists of parameters (one per param group);
    ``spec_of(param)`` (optional) the ReductionSpec a parameter is partitioned over."""

    def __init__(self, groups, module_order, bucket_numel, world_size, rank, spec_of=None):
        self.world_size = world_size
        self.rank = rank
        group_of = {}
        for g, params in enumerate(groups):
            for p in params:
                group_of[p] = g
        order = {id(p): i for i, p in enumerate(module_order)}
        ordered = sorted(group_of, key=lambda p: order.get(id(p), len(order)), reverse=True)
        self.params = ordered
        self.num_groups = len(groups)
        self.slots = {}
        self.buckets = []
        self.group_part_numel = [0] * len(groups)
        bucket_numel = max(int(bucket_numel), 1)
        self._end = 0  # full-space end of the closed buckets
        current = None
        for param in ordered:
            g = group_of[param]
            numel = param.numel()
            spec = spec_of(param) if spec_of is not None else None
            if (current is None or current.group != g or current.spec is not spec
                    or (current.numel > 0 and current.numel + numel > bucket_numel)):
                current = self._close(current)
                current = PartitionBucket(index=len(self.buckets),
                                          group=g,
                                          start=self._end,
                                          numel=0,
                                          padded=0,
                                          part_offset=self.group_part_numel[g],
                                          world=spec.world_size if spec is not None else world_size,
                                          rank=spec.rank if spec is not None else rank,
                                          spec=spec)
                self.buckets.append(current)
            self.slots[param] = PartitionSlot(offset=current.start + current.numel,
                                              numel=numel,
                                              shape=param.shape,
                                              bucket=current.index,
                                              group=g)
            current.params.append(param)
            current.numel += numel
        self._close(current)
        self.numel = self._end

    def _close(self, bucket):
        if bucket is not None:
            world = bucket.world
            bucket.padded = max(world, -(-bucket.numel // world) * world)
            bucket.chunk = bucket.padded // world
            self.group_part_numel[bucket.group] += bucket.chunk
            self._end += bucket.padded
        return None

    # full space ------------------------------------------------------------
    def full_view(self, buffer, param):
        slot = self.slots[param]
        return buffer.narrow(0, slot.offset, slot.numel).view(slot.shape)

    def bucket_full(self, buffer, bucket):
        return buffer.narrow(0, bucket.start, bucket.padded)

    def bucket_own_chunk_full(self, buffer, bucket):
        """This rank's chunk of ``bucket`` inside a full-space buffer."""
        return buffer.narrow(0, bucket.start + bucket.rank * bucket.chunk, bucket.chunk)

    # partition space -------------------------------------------------------
    def bucket_part(self, part_buffer, bucket):
        """This rank's chunk of ``bucket`` inside its group's partition buffer."""
        return part_buffer.narrow(0, bucket.part_offset, bucket.chunk)

    def owned_ranges(self, param):
        """Pieces of ``param`` this rank owns: (start in param's flat view, length, offset in group partition)."""
        slot = self.slots[param]
        bucket = self.buckets[slot.bucket]
        chunk_lo = bucket.start + bucket.rank * bucket.chunk
        chunk_hi = chunk_lo + bucket.chunk
        lo = max(slot.offset, chunk_lo)
        hi = min(slot.offset + slot.numel, chunk_hi)
        if hi <= lo:
            return None
        return lo - slot.offset, hi - lo, bucket.part_offset + (lo - chunk_lo)


@dataclass
class UnitShardSlot:
    """Where one stage-3 parameter's shard lives in its group partition."""
    unit: int
    group: int  # ``num_groups`` for a frozen parameter (the frozen shards' buffer)
    part_offset: int
    shard: int
    rank: int = 0  # this rank's index in the group the parameter is sharded over (its unit's)


class UnitPartitionLayout:
    """Stage 3: per param group, the rank's partition is its shards of the group's parameters, unit by unit.

    ``group_of`` maps each trainable parameter to its optimizer param group; every other
    parameter of the units is frozen and goes to a last pseudo-group (``num_groups``).
    ``segments[u]`` lists, for unit ``u``, the runs of its row that belong to one group:
    ``(group, part_offset, column, length)``, so a unit's piece of a group partition is one
    contiguous segment.
    """

    def __init__(self, units, group_of, num_groups, world_size, rank):
        self.world_size = world_size
        self.rank = rank
        self.num_groups = num_groups
        self.slots = {}
        self.segments = []
        part_numel = [0] * (num_groups + 1)
        for unit in units:
            segments = []
            for param, column, shard in zip(unit.params, unit.columns, unit.shards):
                g = group_of.get(param, num_groups)
                if segments and segments[-1][0] == g:
                    group, offset, start, length = segments[-1]
                    segments[-1] = (group, offset, start, length + shard)
                else:
                    segments.append((g, part_numel[g], column, shard))
                self.slots[param] = UnitShardSlot(unit=unit.index,
                                                  group=g,
                                                  part_offset=part_numel[g],
                                                  shard=shard,
                                                  rank=rank if unit.spec is None else unit.spec.rank)
                part_numel[g] += shard
            self.segments.append(segments)
        self.group_part_numel = part_numel[:num_groups]
        self.frozen_part_numel = part_numel[num_groups]
        self.params = [p for u in units for p in u.params if p.requires_grad and p in group_of]

    def shard_view(self, buffer, param):
        """``param``'s shard inside a group partition (or the frozen shards' buffer) ``buffer``."""
        slot = self.slots[param]
        return buffer.narrow(0, slot.part_offset, slot.shard)
