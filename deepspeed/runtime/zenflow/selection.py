# SPDX-License-Identifier: Apache-2.0
"""ZenFlow's selection: which columns of which weights the device updates every step, and where they live.

A weight ``W`` of shape ``(R, ...)`` is seen as ``R`` rows of ``C = numel / R`` elements (a linear
layer's ``(out, in)`` weight: its columns are its input features); its *column* ``j`` is
``W.view(R, C)[:, j]``. The device updates the top ``k = max(1, int(topk_ratio * C))`` columns of
every weight by the L1 norm of their gradient (upstream's rule), and every parameter of fewer than
two dimensions (biases, norms) whole.

Selecting. Every selectable weight (all ranks list the same parameters in the same order) owns a
fixed range of one *column-norm vector* of ``sum C`` entries, laid out identically on every rank
whatever it holds. From a step's gradient, held in the rank's partitions (each rank holds a
contiguous piece of some parameters, which may start or end inside a row, and nothing of others),
every rank adds ``|g|`` summed over the rows it holds into that vector, zeros elsewhere; one
all-reduce of the vector gives every rank every column's L1 norm, and the top ``k`` columns of each
weight are chosen (ties broken by torch.topk, which sees identical data on every rank). The
selection is the same on every rank, and the one a single rank would make from the same gradient
(up to the rounding of the sum), whatever the world size and the partitioning.

Expert parameters (``deepspeed.moe``, AutoEP) are partitioned over their expert-data-parallel group, and
ranks of different expert-parallel ranks hold different experts under the same place in the list. Each
weight's entries of the column-norm vector are therefore summed over the group that weight is
partitioned over (``group_of``; one all-reduce per distinct group, in the order of first appearance,
which is the same on every rank): every rank holding an expert sees the column norms of that expert's
global-mean gradient, as a single rank holding every expert would. A fused expert weight of shape
``(E, R, ...)`` (``blocks_of`` gives ``E``) is ``E`` weights of ``R`` rows each, one per expert, so
that the selection does not depend on how many experts a rank holds.

Layout. The elements a rank updates on the device, per param group, are packed into one flat
*selected buffer*, piece by piece: a non-selectable piece whole; for a selectable piece, its block
of whole rows (``n_rows x k`` elements, row-major), then each row it holds in part (the selected
columns inside the part). :meth:`ColumnSelection.gather` copies those elements out of
partition-shaped tensors (gradient, master, moments) into selected buffers;
:meth:`ColumnSelection.scatter` writes selected buffers back into partition-shaped tensors, or
into the *target* tensors the caller named for each piece (the model's 16-bit storage). Both run
on any device (index tensors are kept on the host and on the device).
"""

from dataclasses import dataclass, field
from typing import List, Optional

import torch

import deepspeed.comm as dist


def columns_selected(columns, topk_ratio):
    """How many of a weight's ``columns`` are selected: ``max(1, int(topk_ratio * columns))`` (upstream's)."""
    if columns <= 0:
        return 0
    return min(columns, max(1, int(float(topk_ratio) * columns)))


@dataclass(frozen=True)
class Piece:
    """The part of one trainable parameter that this rank holds.

    ``start``/``length``: its range in the parameter's flat view; ``part_offset``: where that range starts in the
    group partition; ``target_offset``: where it starts in the group's target tensor (the model's storage).
    """
    param: torch.Tensor
    shape: tuple
    group: int
    start: int
    length: int
    part_offset: int
    target_offset: int


@dataclass(eq=False)
class _Weight:
    """One selectable parameter (or one expert's block of a fused expert weight): the same list, in the same
    order, on every rank."""
    param: torch.Tensor
    rows: int
    cols: int
    norm_offset: int  # where its columns start in the column-norm vector
    k: int  # columns selected
    block: int = 0  # the expert of a fused expert weight (its elements start at block * rows * cols)
    blocks: int = 1  # experts in the fused weight
    fused: bool = False  # one expert's block of a fused expert weight
    reduce: int = 0  # index of the group its column norms are summed over (``ColumnSelection.groups``)


@dataclass(eq=False)
class _Split:
    """A selectable piece cut into whole rows and rows held in part."""
    weight: int
    first_full: int = 0  # whole rows held: [first_full, end_full)
    end_full: int = 0
    partials: list = field(default_factory=list)  # (row, first column, end column) of rows held in part


@dataclass
class _Op:
    """One copy between a partition-shaped tensor and a selected buffer.

    ``n_rows == 0``: a contiguous run of ``width`` elements taken whole. Otherwise ``n_rows`` rows of ``width``
    elements starting at the offsets, of which the columns ``ids`` (relative to the run's first column) are taken.
    """
    part_offset: int
    target_offset: int
    n_rows: int
    width: int
    sel_offset: int
    ids: Optional[torch.Tensor] = None  # host
    ids_device: Optional[torch.Tensor] = None
    piece: int = -1
    weight: int = -1

    @property
    def numel(self):
        return self.width if self.n_rows == 0 else self.n_rows * self.ids.numel()

    @property
    def span(self):
        return self.width if self.n_rows == 0 else self.n_rows * self.width


class ColumnSelection:
    """The columns ZenFlow updates on the device (see the module docstring).

    ``weights``: ``[(param, shape)]`` for every trainable parameter, the same list on every rank; ``pieces``: this
    rank's :class:`Piece` objects; ``device``: where column norms are reduced; ``group``: the process group.
    ``group_of(param)`` (optional): ``(group, size)``, the group a parameter is partitioned over and its size (its
    column norms are summed there; without it: ``group``); ``blocks_of(param)`` (optional): the experts of a fused
    expert weight (None: not one). Until :meth:`select` is called only the non-selectable parameters are selected.
    """

    def __init__(self, weights, pieces, num_groups, topk_ratio, device, group=None, group_of=None, blocks_of=None):
        self.topk_ratio = float(topk_ratio)
        self.device = torch.device(device)
        self.group = group
        self.num_groups = num_groups
        self.weights: List[_Weight] = []
        self.groups = []  # (group, size): where column norms are summed, in order of first appearance
        weight_of = {}  # param -> index of its first weight (a fused expert weight's blocks follow it)
        total = 0
        for param, shape in weights:
            numel = _numel(shape)
            if len(shape) < 2 or numel == 0:
                continue
            fused = blocks_of(param) if blocks_of is not None and len(shape) >= 3 else None
            blocks = 1 if fused is None else int(fused)  # a fused weight of one expert is one weight of shape[1] rows
            rows = int(shape[0]) if fused is None else int(shape[1])
            cols = numel // (blocks * rows)
            reduce = self._group_index(group_of(param) if group_of is not None else (group, _size(group)))
            weight_of[param] = len(self.weights)
            for block in range(blocks):
                self.weights.append(
                    _Weight(param,
                            rows,
                            cols,
                            total,
                            columns_selected(cols, self.topk_ratio),
                            block=block,
                            blocks=blocks,
                            fused=fused is not None,
                            reduce=reduce))
                total += cols
        self.cols_total = total
        # entries of the column-norm vector per group (None: all of them, the group is the only one)
        self.group_entries = [None] if len(self.groups) <= 1 else [
            torch.cat([torch.arange(w.norm_offset, w.norm_offset + w.cols) for w in self.weights if w.reduce == i])
            for i in range(len(self.groups))
        ]
        self.pieces: List[Piece] = []
        piece_weights = []
        for piece in pieces:
            if piece.length <= 0:
                continue
            first = weight_of.get(piece.param)
            if first is None or self.weights[first].blocks == 1:  # a fused weight of one expert: offsets as they are
                self.pieces.append(piece)
                piece_weights.append(first)
                continue
            for sub, block in _block_pieces(piece, self.weights[first]):
                self.pieces.append(sub)
                piece_weights.append(first + block)
        self.splits = [self._split(p, w) for p, w in zip(self.pieces, piece_weights)]
        self.cols = {}  # weight index -> selected columns (sorted), once selected
        self._build_ops()

    def _group_index(self, key):
        group, size = key
        for i, (known, known_size) in enumerate(self.groups):
            if known is group and known_size == size:  # one rank's group may be None, like the default group
                return i
        self.groups.append((group, int(size)))
        return len(self.groups) - 1

    def reduce_by_group(self, vector, entries_of, dtype=torch.float32):
        """Sum ``vector`` (host) over ranks, each group's ``entries_of(i)`` over group ``i`` (a collective per group
        of more than one rank, in the same order on every rank); returns the host result."""
        if not dist.is_initialized():
            return vector
        for i, (group, size) in enumerate(self.groups or [(self.group, _size(self.group))]):
            if size <= 1:
                continue
            entries = entries_of(i)
            if entries is None:
                reduced = vector.to(dtype).to(self.device)
                dist.all_reduce(reduced, group=group)
                vector = reduced.to(vector.dtype).cpu()
                continue
            reduced = vector[entries].to(dtype).to(self.device)
            dist.all_reduce(reduced, group=group)
            vector[entries] = reduced.to(vector.dtype).cpu()
        return vector

    def _split(self, piece, weight):
        if weight is None:
            return None
        c = self.weights[weight].cols
        lo, hi = piece.start, piece.start + piece.length
        split = _Split(weight)
        first_full, end_full = -(-lo // c), hi // c
        if first_full > end_full:  # inside one row, touching neither of its ends
            split.first_full = split.end_full = first_full
            split.partials.append((lo // c, lo - (lo // c) * c, hi - (lo // c) * c))
            return split
        split.first_full, split.end_full = first_full, end_full
        if lo < first_full * c:
            split.partials.append((lo // c, lo - (lo // c) * c, c))
        if end_full * c < hi:
            split.partials.append((end_full, 0, hi - end_full * c))
        return split

    # ------------------------------------------------------------- selecting
    @torch.no_grad()
    def column_norms(self, parts):
        """Every column's gradient L1 norm (a float32 host vector of ``cols_total`` entries, weight by weight), from
        this rank's partitions, summed over ranks (a collective whose length is the same on every rank)."""
        norms = torch.zeros(max(self.cols_total, 1), dtype=torch.float32)
        for piece, split in zip(self.pieces, self.splits):
            if split is None:
                continue
            weight = self.weights[split.weight]
            part = parts[piece.group]
            c = weight.cols
            n_full = split.end_full - split.first_full
            if n_full > 0:
                block = part.narrow(0, piece.part_offset + split.first_full * c - piece.start, n_full * c)
                sums = block.view(n_full, c).abs().sum(dim=0, dtype=torch.float32)
                norms.narrow(0, weight.norm_offset, c).add_(sums.cpu())
            for row, c0, c1 in split.partials:
                run = part.narrow(0, piece.part_offset + row * c + c0 - piece.start, c1 - c0)
                norms.narrow(0, weight.norm_offset + c0, c1 - c0).add_(run.abs().float().cpu())
        return self.reduce_by_group(norms, lambda i: self.group_entries[i])

    @torch.no_grad()
    def select(self, parts):
        """Choose the top columns of every weight from the gradient in ``parts`` (collective); rebuild the layout.
        Returns the reduced column norms."""
        norms = self.column_norms(parts)
        cols = {}
        for index, weight in enumerate(self.weights):
            vector = norms.narrow(0, weight.norm_offset, weight.cols)
            cols[index] = torch.topk(vector, weight.k, sorted=False).indices.sort().values
        self.set_columns(cols)
        return norms

    def set_columns(self, cols):
        """Use ``cols`` (weight index -> sorted column ids, as :meth:`state` gives them), e.g. from a checkpoint."""
        self.cols = {int(index): torch.as_tensor(c, dtype=torch.long).cpu() for index, c in cols.items()}
        self._build_ops()

    def selected_columns(self):
        """Parameter -> its selected columns (sorted), for every selectable weight (empty before a selection); a
        fused expert weight's are stacked, one row per expert."""
        out = {}
        for index, cols in sorted(self.cols.items()):
            weight = self.weights[index]
            if not weight.fused:
                out[weight.param] = cols
            else:
                out.setdefault(weight.param, []).append(cols)
        return {p: torch.stack(c) if isinstance(c, list) else c for p, c in out.items()}

    def _build_ops(self):
        self.ops = [[] for _ in range(self.num_groups)]
        self.numel = [0] * self.num_groups
        for index, (piece, split) in enumerate(zip(self.pieces, self.splits)):
            g = piece.group
            if split is None:
                self._add(g, _Op(piece.part_offset, piece.target_offset, 0, piece.length, 0, piece=index))
                continue
            chosen = self.cols.get(split.weight)
            if chosen is None:
                continue
            c = self.weights[split.weight].cols
            n_full = split.end_full - split.first_full
            if n_full > 0 and chosen.numel():
                shift = split.first_full * c - piece.start
                self._add(
                    g,
                    _Op(piece.part_offset + shift,
                        piece.target_offset + shift,
                        n_full,
                        c,
                        0,
                        ids=chosen,
                        ids_device=chosen.to(self.device),
                        piece=index,
                        weight=split.weight))
            for row, c0, c1 in split.partials:
                local = chosen[(chosen >= c0) & (chosen < c1)] - c0
                if not local.numel():
                    continue
                shift = row * c + c0 - piece.start
                self._add(
                    g,
                    _Op(piece.part_offset + shift,
                        piece.target_offset + shift,
                        1,
                        c1 - c0,
                        0,
                        ids=local,
                        ids_device=local.to(self.device),
                        piece=index,
                        weight=split.weight))

    def _add(self, g, op):
        op.sel_offset = self.numel[g]
        self.ops[g].append(op)
        self.numel[g] += op.numel

    # ------------------------------------------------------- gather / scatter
    def new_buffers(self, dtype=torch.float32, device=None, pin_memory=False):
        """Empty selected buffers, one per param group."""
        if pin_memory and torch.cuda.is_available():
            return [torch.empty(n, dtype=dtype, pin_memory=True) for n in self.numel]
        return [torch.empty(n, dtype=dtype, device=device) for n in self.numel]

    @torch.no_grad()
    def gather(self, parts, outs):
        """``outs[g]`` = the selected elements of the partition-shaped ``parts[g]`` (same device, any dtype)."""
        for g, ops in enumerate(self.ops):
            part, out = parts[g], outs[g]
            for op in ops:
                dst = out.narrow(0, op.sel_offset, op.numel)
                src = part.narrow(0, op.part_offset, op.span)
                if op.n_rows == 0:
                    dst.copy_(src)
                    continue
                ids = op.ids if part.device.type == "cpu" else op.ids_device
                rows = src.view(op.n_rows, op.width)
                if dst.dtype == part.dtype:
                    torch.index_select(rows, 1, ids, out=dst.view(op.n_rows, -1))
                else:
                    dst.view(op.n_rows, -1).copy_(rows.index_select(1, ids))
        return outs

    @torch.no_grad()
    def scatter(self, values, targets, at="part"):
        """Write the selected buffers ``values[g]`` into ``targets[g]``: at the partition offsets (``at="part"``,
        partition-shaped tensors) or at the pieces' target offsets (``at="target"``)."""
        for g, ops in enumerate(self.ops):
            value, target = values[g], targets[g]
            for op in ops:
                offset = op.part_offset if at == "part" else op.target_offset
                dst = target.narrow(0, offset, op.span)
                src = value.narrow(0, op.sel_offset, op.numel)
                if op.n_rows == 0:
                    dst.copy_(src)
                    continue
                ids = op.ids if target.device.type == "cpu" else op.ids_device
                rows = src.view(op.n_rows, -1).to(device=target.device, dtype=target.dtype)
                dst.view(op.n_rows, op.width).index_copy_(1, ids, rows)

    # ------------------------------------------------------------ the auto rule
    @torch.no_grad()
    def weight_sums(self, parts, selected):
        """Per selectable weight, this rank's share of ``(sum of g^2 over the weight, sum over its selected
        elements)``, from the partitions and their gathered selected buffers (float64 host vector of ``2 x
        len(weights)``: totals, then selected sums)."""
        n = len(self.weights)
        sums = torch.zeros(2 * n, dtype=torch.float64)
        for piece, split in zip(self.pieces, self.splits):
            if split is not None:
                run = parts[piece.group].narrow(0, piece.part_offset, piece.length)
                sums[split.weight] += float(torch.linalg.vector_norm(run, dtype=torch.float32))**2
        for g, ops in enumerate(self.ops):
            for op in ops:
                if op.weight >= 0:
                    run = selected[g].narrow(0, op.sel_offset, op.numel)
                    sums[n + op.weight] += float(torch.linalg.vector_norm(run, dtype=torch.float32))**2
        return sums

    def weight_sum_entries(self, i):
        """The entries of :meth:`weight_sums`' vector that group ``i`` sums (None: all, the only group)."""
        if len(self.groups) <= 1:
            return None
        n = len(self.weights)
        ids = [w for w, weight in enumerate(self.weights) if weight.reduce == i]
        return torch.tensor(ids + [n + w for w in ids], dtype=torch.long)

    def state(self):
        """The selection, for a checkpoint: weight index (selectable parameters in their fixed order) -> columns."""
        return {index: cols.clone() for index, cols in self.cols.items()}

    def selected_share(self):
        """Elements this rank updates on the device / elements it holds."""
        held = sum(p.length for p in self.pieces)
        return sum(self.numel) / held if held else 0.0


def _block_pieces(piece, weight):
    """``piece`` of a fused expert weight cut at its experts' boundaries: ``[(piece of one expert, expert)]``,
    each starting relative to its expert's first element."""
    size = weight.rows * weight.cols
    out = []
    lo, hi = piece.start, piece.start + piece.length
    while lo < hi:
        block = lo // size
        end = min(hi, (block + 1) * size)
        shift = lo - piece.start
        out.append((Piece(piece.param, piece.shape, piece.group, lo - block * size, end - lo,
                          piece.part_offset + shift, piece.target_offset + shift), block))
        lo = end
    return out


def _size(group):
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _numel(shape):
    out = 1
    for s in shape:
        out *= int(s)
    return out
