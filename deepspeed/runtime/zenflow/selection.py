# SPDX-License-Identifier: Apache-2.0
"""ZenFlow's selection: which rows of which weights the device updates every step, and where they live.

A *row* of a weight ``W`` is ``W[i]`` (one output channel of a linear or convolution weight),
contiguous in memory; a weight of ``R`` rows has rows of ``C = numel / R`` elements. Parameters
with fewer than two dimensions (biases, norms) are always updated on the device, whole.

Selecting. Every selectable weight of the layout (all ranks build the same layout, so the same
list in the same order) owns a fixed range of one *row-norm vector* of ``sum R`` entries, laid
out identically on every rank whatever it holds. From a step's window gradient, held in the
rank's partitions (ZeRO 1/2: each rank holds a contiguous piece of some parameters, which may
start or end inside a row, and nothing of others), every rank adds the squared L2 norm of the
pieces of rows it holds into that vector, zeros elsewhere; one all-reduce of the vector (same
length everywhere, not an all-gather of gradients) gives every rank every row's squared norm,
and the top ``k = ceil(topk_ratio * R)`` rows of each weight are selected (ties broken by
torch.topk, which sees identical data on every rank). The selection is therefore the same on
every rank, and the one a single rank would make from the same global gradient (up to the
rounding of the sum); each rank updates the elements of the selected rows that it holds.

Layout. The elements a rank updates on the device, per param group, are packed into one flat
*selected buffer*, piece by piece in layout order: a non-selectable piece whole, then for a
selectable piece its selected whole rows (``k_local x C``), then its selected partial rows.
:meth:`RowSelection.gather` copies those elements out of a partition-shaped tensor (gradient,
master, moments) into a selected buffer; :meth:`RowSelection.scatter` writes a selected buffer
back into a partition-shaped tensor or, with ``space="full"``, into the flat 16-bit model
parameters (the full space of ``PartitionedLayout``). Both run on any device (index tensors
are kept on the host and on the device).
"""

import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch

import deepspeed.comm as dist
from deepspeed.runtime.zero import host_math


def rows_selected(rows, topk_ratio):
    """How many of a weight's ``rows`` rows are selected: ``ceil(topk_ratio * rows)``, at least one."""
    return min(rows, max(1, math.ceil(float(topk_ratio) * rows)))


@dataclass(eq=False)
class _Weight:
    """One selectable parameter of the layout: the same list, in the same order, on every rank."""
    param: torch.Tensor
    rows: int
    row_len: int
    norm_offset: int  # where its rows start in the row-norm vector
    k: int  # rows selected per step


@dataclass(eq=False)
class _Piece:
    """The part of one trainable parameter that this rank holds."""
    param: torch.Tensor
    group: int
    start: int  # first element of the parameter held here
    length: int
    part_offset: int  # offset of that element in the group partition
    full_offset: int  # ... and in the full space (the flat 16-bit parameters)
    rows: int = 1
    row_len: int = 0
    selectable: bool = False
    weight: int = -1  # index of its _Weight (selectable pieces)
    norm_offset: int = 0  # where its weight's rows start in the row-norm vector
    first_full: int = 0  # whole rows held: [first_full, end_full)
    end_full: int = 0
    partials: list = field(default_factory=list)  # (row, element start, element end) of rows held in part


@dataclass
class _Op:
    """One copy between a partition-shaped tensor and a selected buffer."""
    part_offset: int
    full_offset: int
    numel: int
    sel_offset: int
    row_len: int = 0  # 0: a contiguous run; else ``numel // row_len`` rows of which ``ids`` are taken
    ids: Optional[torch.Tensor] = None  # local row ids (host)
    ids_device: Optional[torch.Tensor] = None
    piece: int = -1  # index of the piece it belongs to


class RowSelection:
    """The rows ZenFlow updates on the device (see the module docstring).

    ``layout`` is the stage's :class:`~deepspeed.runtime.zero.partition_layout.PartitionedLayout`; ``device``
    the rank's device (row norms are reduced there). Until :meth:`select` is called, only the
    non-selectable parameters are selected.
    """

    def __init__(self, layout, topk_ratio, device, group=None):
        self.layout = layout
        self.topk_ratio = float(topk_ratio)
        self.device = torch.device(device)
        self.group = group
        self.num_groups = layout.num_groups
        self.weights: List[_Weight] = []
        weight_of = {}
        rows_total = 0
        for param in layout.params:  # every rank's layout lists the same parameters in the same order
            numel = layout.slots[param].numel
            if param.dim() < 2 or numel == 0:
                continue
            rows = param.shape[0]
            weight_of[param] = len(self.weights)
            self.weights.append(_Weight(param, rows, numel // rows, rows_total, rows_selected(rows, self.topk_ratio)))
            rows_total += rows
        self.rows_total = rows_total
        self.pieces: List[_Piece] = []
        for param in layout.params:
            owned = layout.owned_ranges(param)
            slot = layout.slots[param]
            if owned is None or slot.numel == 0:
                continue
            start, length, part_offset = owned
            piece = _Piece(param, slot.group, start, length, part_offset, slot.offset + start)
            if param in weight_of:
                weight = self.weights[weight_of[param]]
                piece.selectable = True
                piece.weight = weight_of[param]
                piece.rows = weight.rows
                piece.row_len = weight.row_len
                piece.norm_offset = weight.norm_offset
                self._split_rows(piece)
            self.pieces.append(piece)
        self.rows = {}  # weight index -> selected rows (sorted), once selected
        self._build_ops()

    @staticmethod
    def _split_rows(piece):
        c = piece.row_len
        lo, hi = piece.start, piece.start + piece.length
        first_full = -(-lo // c)
        end_full = hi // c
        piece.partials = []
        if first_full > end_full:  # inside one row, touching neither of its ends
            piece.first_full = piece.end_full = first_full
            piece.partials.append((lo // c, lo, hi))
            return
        piece.first_full, piece.end_full = first_full, end_full
        if lo < first_full * c:
            piece.partials.append((lo // c, lo, first_full * c))
        if end_full * c < hi:
            piece.partials.append((end_full, end_full * c, hi))

    # ------------------------------------------------------------- selecting
    @torch.no_grad()
    def row_sq_norms(self, parts):
        """Every row's squared gradient norm (a float32 host vector of ``rows_total`` entries, weight by weight in
        layout order), from this rank's partitions, summed over ranks (a collective whose length is the same on
        every rank: a rank adds what it holds and leaves zeros elsewhere)."""
        norms = torch.zeros(max(self.rows_total, 1), dtype=torch.float32)
        for piece in self.pieces:
            if not piece.selectable:
                continue
            part = parts[piece.group]
            c = piece.row_len
            n_full = piece.end_full - piece.first_full
            if n_full > 0:
                offset = piece.part_offset + piece.first_full * c - piece.start
                block = part.narrow(0, offset, n_full * c).view(n_full, c)
                row = piece.norm_offset + piece.first_full
                if block.device.type == "cpu":
                    host_math.row_sq_norms(block, norms.narrow(0, row, n_full))
                else:
                    norms.narrow(0, row,
                                 n_full).copy_(torch.linalg.vector_norm(block, dim=1, dtype=torch.float32).cpu()**2)
            for r, e0, e1 in piece.partials:
                run = part.narrow(0, piece.part_offset + e0 - piece.start, e1 - e0)
                norms[piece.norm_offset + r] += torch.linalg.vector_norm(run, dtype=torch.float32)**2
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            reduced = norms.to(self.device)
            dist.all_reduce(reduced, group=self.group)
            norms = reduced.cpu()
        return norms

    @torch.no_grad()
    def select(self, parts):
        """Choose the top rows of every weight from the gradient in ``parts`` (collective); rebuild the layout.
        Returns the reduced row norms."""
        norms = self.row_sq_norms(parts)
        rows = {}
        for index, weight in enumerate(self.weights):
            vector = norms.narrow(0, weight.norm_offset, weight.rows)
            rows[index] = torch.topk(vector, weight.k, sorted=False).indices.sort().values
        self.set_rows(rows)
        return norms

    def set_rows(self, rows):
        """Use ``rows`` (weight index -> sorted row ids, as :meth:`state` gives them), e.g. from a checkpoint."""
        self.rows = {int(index): torch.as_tensor(r, dtype=torch.long).cpu() for index, r in rows.items()}
        self._build_ops()

    def selected_rows(self):
        """Parameter -> its selected rows (sorted), for every selectable weight (empty before a selection)."""
        return {self.weights[index].param: rows for index, rows in self.rows.items()}

    def _build_ops(self):
        self.ops = [[] for _ in range(self.num_groups)]
        self.numel = [0] * self.num_groups
        for index, piece in enumerate(self.pieces):
            g = piece.group
            ops = self.ops[g]
            if not piece.selectable:
                ops.append(_Op(piece.part_offset, piece.full_offset, piece.length, self.numel[g], piece=index))
                self.numel[g] += piece.length
                continue
            selected = self.rows.get(piece.weight)
            if selected is None:
                continue
            c = piece.row_len
            n_full = piece.end_full - piece.first_full
            if n_full > 0:
                mask = (selected >= piece.first_full) & (selected < piece.end_full)
                local = selected[mask] - piece.first_full
                if local.numel():
                    shift = piece.first_full * c - piece.start
                    ops.append(
                        _Op(piece.part_offset + shift,
                            piece.full_offset + shift,
                            n_full * c,
                            self.numel[g],
                            row_len=c,
                            ids=local,
                            ids_device=local.to(self.device),
                            piece=index))
                    self.numel[g] += local.numel() * c
            chosen = set(selected.tolist())
            for r, e0, e1 in piece.partials:
                if r in chosen:
                    shift = e0 - piece.start
                    ops.append(
                        _Op(piece.part_offset + shift, piece.full_offset + shift, e1 - e0, self.numel[g], piece=index))
                    self.numel[g] += e1 - e0

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
                dst = out.narrow(0, op.sel_offset, op.numel if not op.row_len else op.ids.numel() * op.row_len)
                src = part.narrow(0, op.part_offset, op.numel)
                if not op.row_len:
                    dst.copy_(src)
                    continue
                ids = op.ids if part.device.type == "cpu" else op.ids_device
                rows = src.view(-1, op.row_len)
                if dst.dtype == part.dtype:
                    torch.index_select(rows, 0, ids, out=dst.view(-1, op.row_len))
                else:
                    dst.view(-1, op.row_len).copy_(rows.index_select(0, ids))
        return outs

    @torch.no_grad()
    def scatter(self, values, targets, space="part"):
        """Write the selected buffers ``values[g]`` into ``targets``: partition-shaped tensors per group
        (``space="part"``), or one flat full-space tensor for every group (``space="full"``)."""
        for g, ops in enumerate(self.ops):
            value = values[g]
            target = targets if space == "full" else targets[g]
            for op in ops:
                offset = op.full_offset if space == "full" else op.part_offset
                dst = target.narrow(0, offset, op.numel)
                src = value.narrow(0, op.sel_offset, op.numel if not op.row_len else op.ids.numel() * op.row_len)
                if not op.row_len:
                    dst.copy_(src)
                    continue
                ids = op.ids if target.device.type == "cpu" else op.ids_device
                rows = src.view(-1, op.row_len).to(device=target.device, dtype=target.dtype)
                dst.view(-1, op.row_len).index_copy_(0, ids, rows)

    def state(self):
        """The selection, for a checkpoint: weight index (selectable parameters in layout order) -> its rows."""
        return {index: rows.clone() for index, rows in self.rows.items()}

    def selected_share(self):
        """Elements this rank updates on the device / elements it holds."""
        held = sum(p.length for p in self.pieces)
        return sum(self.numel) / held if held else 0.0
