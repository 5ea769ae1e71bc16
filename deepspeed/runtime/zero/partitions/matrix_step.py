# SPDX-License-Identifier: Apache-2.0
"""The matrix step of ZeRO 1-3: whole-matrix directions (Muon's Newton-Schulz) over flat partitions.

A whole-matrix optimizer (:class:`~deepspeed.ops.muon.muon.MatrixOptimizer`) steps each param group's flat fp32
master partition elementwise, and asks its matrix step for ``O``, the direction of every matrix whose pieces lie
in the partition, computed on the whole matrix. :class:`PartitionedMatrices` answers it with the partition layout
of the stage:

* the group partition is cut into *blocks*, ranges ``[part_offset, part_offset + chunk)`` that are the same on every
  rank (stages 1-2: the buckets, each the rank's chunk of a run of whole parameters; stage 3: runs of whole
  parameters' shards). Gathering a block from every rank (``W * chunk`` elements) gives whole matrices: one range
  of the gathered block per matrix at stages 1-2, ``W`` strided ranges (one shard per rank) at stage 3;
* every matrix has one *owner* rank, chosen once so that the Newton-Schulz work (``rows * cols * min(rows, cols)``)
  is balanced (largest first, to the least loaded rank; the same answer on every rank);
* per block: all-gather the update (the Nesterov momentum), each owner overwrites its matrices with their directions
  and zeroes the others, and a reduce-scatter (sum: one nonzero term per element, so exact) returns each rank its
  chunk, written over the update.

Each matrix's direction is computed once, on one rank, from the whole matrix, wherever the partition boundaries
fall; every rank receives the same bits for the elements it holds. Why all-gather + reduce-scatter rather than
sending each matrix's pieces to its owner and back: per element both move ``(W - 1) / W`` of the block over the wire
each way, but a block needs two equal-chunk collectives (the ones the gradient pipeline already runs, efficient on
NCCL) instead of ``2 W`` point-to-point messages per matrix; and the transient memory is one gathered block (about
one bucket; none on one rank), not a matrix per rank in flight. Upstream's ZeRO 1-2 gathers too, but then
orthogonalizes every matrix on every rank (``W`` times the Newton-Schulz work); here each runs once.
"""

from dataclasses import dataclass, field

import torch

import deepspeed.comm as dist
from deepspeed.runtime.zero.gradients.profiling import ds_range

# Stage 3: elements per rank in one block of a Muon group (whole parameters' shards; at least one parameter).
STAGE3_BLOCK_NUMEL = 1 << 24


@dataclass
class Matrix:
    index: int
    shape: tuple
    ranges: list  # (start, length) in the gathered block, in the matrix's flat order

    @property
    def cost(self):
        rows = self.shape[0]
        cols = 1
        for n in self.shape[1:]:
            cols *= n
        return rows * cols * min(rows, cols)


@dataclass
class MatrixBlock:
    part_offset: int
    chunk: int
    matrices: list = field(default_factory=list)


def assign_owners(matrices, world):
    """Owner rank per matrix index: largest work first, each to the least loaded rank (ties: lowest rank)."""
    load = [0] * world
    owner = {}
    for m in sorted(matrices, key=lambda m: (-m.cost, m.index)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[m.index] = r
        load[r] += m.cost
    return owner


class PartitionedMatrices:
    """The matrix step over flat partitions (see the module docstring).

    ``blocks[g]`` lists the blocks of param group ``g``'s partition (empty for a group with no matrix);
    ``masters[g]`` is the tensor the optimizer steps for group ``g``.
    """

    def __init__(self, blocks, masters, *, world, rank, group, device):
        self.blocks = blocks
        self.group_of = {id(m): g for g, m in enumerate(masters)}
        self.world, self.rank, self.group = world, rank, group
        self.device = torch.device(device)
        self.owner = assign_owners([m for bs in blocks for b in bs for m in b.matrices], world)

    def owned(self):
        """Indices of the matrices this rank orthogonalizes."""
        return sorted(i for i, r in self.owner.items() if r == self.rank)

    @torch.no_grad()
    def directions(self, optimizer, group, param, update):
        """``O`` for the flat partition ``param``, written over its update ``update`` (returned): a collective over
        the stage's group. In place: per block, the gathered update becomes the gathered directions (each owner
        overwrites its matrices, the other ranges are zeroed), so the step needs one gathered block, and nothing
        at all on one rank."""
        g = self.group_of.get(id(param))
        if g is None:
            raise RuntimeError("the matrix step was given a tensor that is not one of the stage's master partitions")
        with ds_range("DS::matrix_step"):
            for block in self.blocks[g]:
                view = update.narrow(0, block.part_offset, block.chunk)
                send = view.to(self.device, torch.float32)
                if self.world == 1:
                    full = send
                else:
                    full = torch.empty(self.world * block.chunk, dtype=torch.float32, device=self.device)
                    dist.all_gather_into_tensor(full, send.contiguous(), group=self.group)
                for matrix in block.matrices:
                    if self.owner[matrix.index] != self.rank:
                        for s, n in matrix.ranges:
                            full.narrow(0, s, n).zero_()
                        continue
                    whole = torch.cat([full.narrow(0, s, n) for s, n in matrix.ranges]).view(matrix.shape)
                    flat = optimizer.direction(group, whole).reshape(-1)
                    done = 0
                    for s, n in matrix.ranges:
                        full.narrow(0, s, n).copy_(flat.narrow(0, done, n))
                        done += n
                if self.world == 1:
                    mine = full
                else:  # one nonzero term per element (its owner's): the sum is exact
                    mine = torch.empty(block.chunk, dtype=torch.float32, device=self.device)
                    dist.reduce_scatter_tensor(mine, full, group=self.group)
                if mine is not view:
                    view.copy_(mine)
        return update


def _check_matrix(param, shape):
    if len(shape) < 2:
        raise ValueError(f"a Muon parameter must be a matrix (ndim >= 2); got shape {tuple(shape)}. Put it in an "
                         "Adam group (use_muon=False)")


def stage12_blocks(layout, muon_groups):
    """Blocks of a :class:`~deepspeed.runtime.zero.partitions.partition_layout.PartitionedLayout`: one per bucket of a
    Muon group (a bucket holds whole parameters; each is one range of the gathered bucket)."""
    blocks = [[] for _ in range(layout.num_groups)]
    index = 0
    for bucket in layout.buckets:
        if bucket.group not in muon_groups:
            continue
        assert bucket.spec is None or not bucket.spec.copies > 1, "Muon buckets are dense"
        block = MatrixBlock(bucket.part_offset, bucket.chunk)
        for param in bucket.params:
            slot = layout.slots[param]
            _check_matrix(param, slot.shape)
            if slot.numel:
                block.matrices.append(Matrix(index, tuple(slot.shape), [(slot.offset - bucket.start, slot.numel)]))
                index += 1
        blocks[bucket.group].append(block)
    return blocks


def stage3_blocks(layout, muon_groups, block_numel=STAGE3_BLOCK_NUMEL):
    """Blocks of a :class:`~deepspeed.runtime.zero.partitions.partition_layout.UnitPartitionLayout`: runs of whole
    parameters' shards (about ``block_numel`` per rank); a parameter's elements are its shard on each rank, in rank
    order."""
    world = layout.world_size
    blocks = [[] for _ in range(layout.num_groups)]
    by_group = {}
    for param, slot in layout.slots.items():
        if slot.group in muon_groups:
            by_group.setdefault(slot.group, []).append((slot.part_offset, param, slot))
    index = 0
    for g in sorted(by_group):
        block = None
        for _, param, slot in sorted(by_group[g], key=lambda t: t[0]):
            shape = tuple(param.ds_shape)
            _check_matrix(param, shape)
            if block is None or (block.chunk and block.chunk + slot.shard > block_numel):
                block = MatrixBlock(slot.part_offset, 0)
                blocks[g].append(block)
            numel = param.ds_numel
            offset = slot.part_offset - block.part_offset
            ranges = []
            for r in range(world):
                n = min(slot.shard, numel - r * slot.shard)
                if n > 0:
                    ranges.append((r, offset, n))
            block.chunk += slot.shard
            if numel:
                block.matrices.append(Matrix(index, shape, ranges))
                index += 1
        for block in blocks[g]:  # ranges in the gathered block: rank r's chunk starts at r * chunk
            for m in block.matrices:
                m.ranges = [(r * block.chunk + off, n) for r, off, n in m.ranges]
    return blocks


def install_matrix_step(stage, blocks_of, spec=None):
    """Give the stage's whole-matrix optimizer (if it has one) its partitioned matrix step.

    ``blocks_of(muon_groups)`` returns the blocks of every param group; ``spec`` (a ReductionSpec) is the group the
    blocks are partitioned over (default: the stage's group). Raises NotImplementedError, on every rank
    (the same config and model), for what the matrix step does not support.
    """
    optimizer = stage.optimizer
    if not hasattr(optimizer, "set_matrix_step"):
        return
    muon_groups = {g for g, group in enumerate(optimizer.param_groups) if optimizer.is_muon_group(group)}
    params = stage.layout.params
    unsupported = [(stage.reduction.has_experts(params), "expert parameters (deepspeed.moe)"),
                   (bool(stage.reduction.tensor), "tensor parallelism (AutoTP)"),
                   (stage.config.zenflow is not None, "ZenFlow (zero_optimization.zenflow)"),
                   (stage.config.optimizer_swap is not None, "offload_optimizer.device 'nvme'"),
                   (stage.config.offload_optimizer is not None
                    and stage.config.offload_ratio < 1.0, "offload_optimizer.ratio < 1")]
    for bad, what in unsupported:
        if bad:
            raise NotImplementedError(f"the Muon optimizer with {what} on ZeRO stage {stage.config.stage} is not "
                                      "supported; see docs/zero.md (Whole-matrix optimizers)")
    group, world, rank = (stage.group, stage.world_size, stage.rank) if spec is None else \
        (spec.group, spec.world_size, spec.rank)
    optimizer.set_matrix_step(
        PartitionedMatrices(blocks_of(muon_groups),
                            stage.masters,
                            world=world,
                            rank=rank,
                            group=group,
                            device=stage.device))
    if stage.config.offload_optimizer and stage.config.muon_momentum_on_device:
        optimizer.momentum_device = stage.device
