# SPDX-License-Identifier: Apache-2.0
"""ZeRO++'s quantized frozen weights (``zero_quantized_nontrainable_weights``): int8 shards, gathered as they are.

Frozen parameters (``requires_grad=False`` at ``initialize``: no optimizer group) form the last segment of their
unit's row (``partition_layout.UnitPartitionLayout``). With the key on, each one's shard on this rank is
block-quantized once, on its own (blocks start at the shard's first element; ``block_quant``'s 8-bit symmetric
format, blocks of ``WEIGHT_BLOCK`` values), and only the codes and scales are kept: per unit one ``uint8`` buffer
holding the segment's float32 scales, then its int8 codes (about a quarter of an fp32 shard's bytes, half of a
bf16 one's). ``param.ds_tensor`` is the int8 view of its codes and ``param.ds_tensor.ds_quant_scale`` the float32
view of its scales, as upstream names them.

A gather sends that buffer unchanged, ahead of the unit's trainable columns (raw, or qwZ-encoded), and every rank
decodes the frozen columns as ``float32(code) * scale`` cast to the model dtype: bitwise ``block_quant``'s
dequantization of the shard. So the values a forward, ``GatheredParameters``, the accessors, the consolidated
16-bit state dict and checkpoints see are those dequantized values; nothing is quantized twice. Writing a frozen
parameter (``GatheredParameters`` with a modifier, ``safe_set_full_fp32_param``, a checkpoint load into another
layout) quantizes its new shard. A checkpoint also keeps the codes and scales (``frozen_quantized_shards``), so a
load into the same layout restores them exactly.
"""

from dataclasses import dataclass

import torch

from deepspeed.runtime.zero.gradients import block_quant

BITS = 8
BLOCK = block_quant.WEIGHT_BLOCK


def block_counts(numel, block=BLOCK):
    """The lengths of the blocks of a shard of ``numel`` values (none for an empty shard)."""
    if numel <= 0:
        return []
    full, rest = divmod(int(numel), int(block))
    return [block] * full + ([rest] if rest else [])


def quantize_shard(values, block=BLOCK):
    """``(codes, scales)`` of a 1-D shard: int8 codes (``numel``) and float32 scales (one per block)."""
    n = values.numel()
    if n == 0:
        return (torch.empty(0, dtype=torch.int8,
                            device=values.device), torch.empty(0, dtype=torch.float32, device=values.device))
    packed = block_quant.quantize_rows(values.reshape(1, -1), BITS, block)[0]
    payload = block_quant.payload_bytes(n, BITS, block)
    return packed[:n].view(torch.int8), packed[payload:].clone().view(torch.float32)


def dequantize(codes, scales, counts, dtype):
    """``float32(code) * scale`` per element (rows of ``codes`` / ``scales`` along the last dimension), as
    ``dtype``; ``counts`` the block lengths (a tensor on their device)."""
    if codes.shape[-1] == 0:
        return torch.empty(codes.shape, dtype=dtype, device=codes.device)
    expanded = scales.repeat_interleave(counts, dim=-1, output_size=codes.shape[-1])
    return (codes.float() * expanded).to(dtype)


@dataclass
class FrozenTail:
    """The quantized frozen segment of one unit on this rank."""
    column: int  # its first column in the unit's row (the trainable columns come before it)
    length: int  # its columns (the frozen parameters' shards)
    scale_numel: int  # float32 scales ahead of the codes
    packed: torch.Tensor  # uint8: scales, then codes (what a gather sends)
    counts: torch.Tensor  # block lengths of the whole segment, parameter after parameter

    @property
    def nbytes(self):
        return self.packed.numel()


class FrozenQuantStore:
    """The quantized frozen shards of a stage-3 engine (module docstring).

    ``frozen_shards`` is the frozen partition in the model dtype (read once here; the caller frees it).
    """

    def __init__(self, units, layout, frozen_shards, model_dtype, device):
        self.layout = layout
        self.model_dtype = model_dtype
        self.tails = {}
        frozen = layout.num_groups
        for unit in units:
            segments = [s for s in layout.segments[unit.index] if s[0] == frozen]
            if not segments:
                continue
            if len(segments) != 1 or segments[0] is not layout.segments[unit.index][-1]:
                raise AssertionError("frozen parameters must form the last segment of their unit")
            _, _, column, length = segments[0]
            params = [p for p in unit.params if layout.slots[p].group == frozen]
            quantized = [quantize_shard(layout.shard_view(frozen_shards, p).to(device)) for p in params]
            scale_numel = sum(s.numel() for _, s in quantized)
            packed = torch.empty(4 * scale_numel + length, dtype=torch.uint8, device=device)
            scales = packed[:4 * scale_numel].view(torch.float32)
            codes = packed[4 * scale_numel:].view(torch.int8)
            counts = []
            at_code = at_scale = 0
            for param, (c, s) in zip(params, quantized):
                code_view = codes.narrow(0, at_code, c.numel())
                scale_view = scales.narrow(0, at_scale, s.numel())
                code_view.copy_(c)
                scale_view.copy_(s)
                code_view.ds_quant_scale = scale_view
                param.ds_tensor = code_view
                param.ds_quant_store = self
                counts += block_counts(c.numel())
                at_code += c.numel()
                at_scale += s.numel()
            self.tails[unit.index] = FrozenTail(column=column,
                                                length=length,
                                                scale_numel=scale_numel,
                                                packed=packed,
                                                counts=torch.tensor(counts, dtype=torch.long, device=device))

    def tail(self, unit_index):
        return self.tails.get(unit_index)

    def nbytes(self):
        """Bytes held by the quantized frozen shards of this rank."""
        return sum(t.nbytes for t in self.tails.values())

    def decode(self, tail, rows, out):
        """The frozen columns ``out`` (``(W, length)``) from the received ``rows`` (``(W, tail.nbytes)`` uint8)."""
        split = 4 * tail.scale_numel
        scales = rows[:, :split].clone(memory_format=torch.contiguous_format).view(torch.float32)
        codes = rows[:, split:].view(torch.int8)
        out.copy_(dequantize(codes, scales, tail.counts, out.dtype))
        return out

    def decode_local(self, tail, out):
        """This rank's frozen columns of a unit (1-D ``out``), from the stored shards."""
        return self.decode(tail, tail.packed.view(1, -1), out.view(1, -1))

    @staticmethod
    def shard_values(param, dtype=None):
        """``param``'s dequantized shard (1-D, ``dtype`` or the model dtype)."""
        codes = param.ds_tensor
        counts = torch.tensor(block_counts(codes.numel()), dtype=torch.long, device=codes.device)
        return dequantize(codes, codes.ds_quant_scale, counts, dtype or param.dtype)

    @staticmethod
    @torch.no_grad()
    def write_shard(param, values):
        """Quantize ``values`` (this rank's whole shard, padding included) into ``param``'s codes and scales."""
        codes, scales = quantize_shard(values.reshape(-1).to(param.ds_tensor.device))
        param.ds_tensor.copy_(codes)
        param.ds_tensor.ds_quant_scale.copy_(scales)

    @staticmethod
    def round_trip_full(param, full, world):
        """The whole value a gather gives once ``full`` was written: each rank's shard quantized and dequantized."""
        shard = param.ds_shard_numel
        flat = torch.zeros(world * shard, dtype=torch.float32, device=full.device)
        flat[:param.ds_numel].copy_(full.reshape(-1))
        pieces = []
        for r in range(world):
            codes, scales = quantize_shard(flat[r * shard:(r + 1) * shard])
            counts = torch.tensor(block_counts(shard), dtype=torch.long, device=flat.device)
            pieces.append(dequantize(codes, scales, counts, param.dtype))
        return torch.cat(pieces)[:param.ds_numel].view(param.ds_shape)

    def partition_values(self, params):
        """The frozen partition in the model dtype (each frozen parameter's dequantized shard at its offset)."""
        layout = self.layout
        out = None
        for param in params:
            if getattr(param, "ds_quant_store", None) is not self:
                continue
            if out is None:
                out = torch.zeros(layout.frozen_part_numel, dtype=self.model_dtype, device=param.ds_tensor.device)
            layout.shard_view(out, param).copy_(self.shard_values(param, self.model_dtype))
        return out

    def load_partition(self, params, values):
        """Quantize a frozen partition (``partition_values``' layout) into the shards."""
        for param in params:
            if getattr(param, "ds_quant_store", None) is self:
                self.write_shard(param, self.layout.shard_view(values, param))


def packed_state(store):
    """The stored codes and scales of every unit (host copies, in unit order): a checkpoint restores them exactly."""
    return [store.tails[i].packed.detach().cpu().clone() for i in sorted(store.tails)]


@torch.no_grad()
def load_packed_state(store, state):
    """Restore :func:`packed_state` of the same layout."""
    order = sorted(store.tails)
    if len(state) != len(order) or any(store.tails[i].nbytes != t.numel() for i, t in zip(order, state)):
        raise ValueError("the checkpoint's quantized frozen shards do not match this engine's layout")
    for i, packed in zip(order, state):
        store.tails[i].packed.copy_(packed)


def is_quantized(param):
    return getattr(param, "ds_quant_store", None) is not None
