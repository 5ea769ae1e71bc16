# SPDX-License-Identifier: Apache-2.0
"""How a ZeRO-3 unit is fetched, per phase: the group, the transport and the wire format (ZeRO++).

A unit's gather sends this rank's row (``C`` values in the model dtype) and receives the ``W`` rows of the
ZeRO group in rank order. :class:`UnitFetchPlan` decides, per gather:

* **the wire format** (:class:`RawWire` or :class:`QuantizedWire`). With ``zero_quantized_weights`` (qwZ) a
  row travels as int8 blocks and their scales (``block_quant``), about a quarter of fp32's bytes and half of
  bf16's, and is decoded into the model dtype after the collective; otherwise it travels as it is.
* **the group** (hpZ, ``zero_hpz_partition_size = h > 1``). A forward gather runs over the whole ZeRO group
  (the *primary* partition) and keeps this rank's *secondary* shard: the received wire rows
  ``[l * N, (l + 1) * N)`` (``l`` its position in its node of ``h`` ranks, ``N = W / h`` nodes). A backward
  gather of a unit whose secondary shard is kept runs over the node group only: each of the ``h`` members
  sends its ``N`` rows, which arrive as all ``W`` rows in order. The rows are the very bytes the forward
  received, so the backward sees bitwise the forward's parameters (with qwZ too: nothing is quantized
  twice), while its all-gather stays inside the node.
* **quantized frozen weights** (``zero_quantized_nontrainable_weights``, ``frozen_quant.py``). A unit with
  frozen parameters sends their stored int8 codes and scales as they are, ahead of its trainable columns (in
  the wire format above); the frozen columns are dequantized after the collective. The wire row is then bytes.

Expert units of expert-parallel size > 1 are fetched by a plan of their own per expert group
(``Stage3._zeropp``): ``group`` their expert-data-parallel group, ``world_size`` its size, the same wire, and as
node axis the group's sub-nodes (``node_axis.build_expert_node_axis``), or none where a sub-node is one rank.

The secondary shards are dropped whenever the 16-bit shards may have changed (:meth:`invalidate`: the
step, a checkpoint load, ``set_fp32_param``, a modifying ``GatheredParameters``); a backward gather without
one uses the primary partition (and keeps a secondary shard for the next).
"""

import torch

from deepspeed.runtime.zero.gradients import block_quant
from deepspeed.runtime.zero.gradients.transport import DEFAULT_TRANSPORT, CommTransport


class RawWire:
    """Rows travel in the model dtype, as they are."""

    quantized = False

    def encode(self, row):
        return row

    def decode(self, rows, numel, dtype):
        """``rows`` (``(W, wire numel)``) as ``(W, numel)`` values of ``dtype``."""
        return rows


class QuantizedWire:
    """Rows travel as symmetric int8 blocks with float32 scales (qwZ; ``block_quant``)."""

    quantized = True

    def __init__(self, bits=block_quant.WEIGHT_BITS, block=block_quant.WEIGHT_BLOCK):
        self.bits = bits
        self.block = block

    def encode(self, row):
        return block_quant.quantize_rows(row.view(1, -1), self.bits, self.block).view(-1)

    def decode(self, rows, numel, dtype):
        out = torch.empty(rows.shape[0], numel, dtype=dtype, device=rows.device)
        return block_quant.dequantize_rows(rows, numel, self.bits, self.block, out)


class UnitFetchPlan:
    """The wire and the groups of ZeRO-3 gathers (module docstring).

    ``group`` is the ZeRO group (``world_size`` ranks); ``node_axis`` a
    :class:`~deepspeed.utils.node_axis.NodeAxis` of that group, or None (no hpZ).
    """

    def __init__(self, group, world_size, *, quantized_weights=False, node_axis=None, frozen=None):
        self.group = group
        self.frozen = frozen  # a FrozenQuantStore (quantized frozen weights), or None
        self.world_size = world_size
        self.wire = QuantizedWire() if quantized_weights else RawWire()
        self.transport = CommTransport("qwZ") if quantized_weights else DEFAULT_TRANSPORT
        hpz = node_axis is not None and node_axis.size > 1 and world_size > 1
        self.node_axis = node_axis if hpz else None
        self.node_transport = CommTransport("qwZ:hpz_node" if quantized_weights else "hpz_node") if hpz else None
        self._secondary = {}  # unit index -> this rank's N wire rows, kept since the last forward gather

    @property
    def hierarchical(self):
        return self.node_axis is not None

    def launch(self, send, backward, unit_index, keep=True):
        """Start the all-gather of a unit whose row is ``send`` (``None`` when the secondary shard serves).

        Returns ``(work, wire buffer, keep)``: whether :meth:`finish` keeps a secondary shard (hpZ, and ``keep``:
        a persistent unit, never gathered again in a backward, keeps none).
        """
        secondary = self._secondary.get(unit_index) if backward and self.node_axis is not None else None
        if secondary is not None:
            buffer = torch.empty(self.world_size * secondary.numel() // self.node_axis.nodes,
                                 dtype=secondary.dtype,
                                 device=secondary.device)
            return self.node_transport.all_gather(buffer, secondary, self.node_axis.node_group), buffer, False
        tail = self.frozen.tail(unit_index) if self.frozen is not None else None
        wire = self.wire.encode(send) if tail is None else self._with_frozen(tail, send)
        buffer = torch.empty(self.world_size * wire.numel(), dtype=wire.dtype, device=wire.device)
        return self.transport.all_gather(buffer, wire, self.group), buffer, keep and self.node_axis is not None

    def _with_frozen(self, tail, send):
        """One uint8 wire row: the stored frozen codes and scales, then the trainable columns ``send`` encoded."""
        if send is None or send.numel() == 0:
            return tail.packed
        encoded = self.wire.encode(send)
        return torch.cat((tail.packed, encoded.reshape(-1).view(torch.uint8)))

    def needs_row(self, backward, unit_index):
        """Whether a gather in this phase needs this rank's row (False: the secondary shard serves)."""
        return not (backward and self.node_axis is not None and unit_index in self._secondary)

    def finish(self, buffer, numel, dtype, keep, unit_index):
        """The ``(W, numel)`` gathered values of ``dtype`` from the completed wire ``buffer``; keeps the secondary
        shard when ``keep``."""
        rows = buffer.view(self.world_size, -1)
        if keep:
            nodes = self.node_axis.nodes
            start = self.node_axis.node_rank * nodes
            self._secondary[unit_index] = rows[start:start + nodes].clone().view(-1)
        tail = self.frozen.tail(unit_index) if self.frozen is not None else None
        if tail is None:
            return self.wire.decode(rows, numel, dtype)
        out = torch.empty(rows.shape[0], numel, dtype=dtype, device=rows.device)
        trainable = numel - tail.length
        if trainable:
            body = rows[:, tail.nbytes:].clone(memory_format=torch.contiguous_format)
            if not self.wire.quantized:
                body = body.view(dtype)
            out[:, :trainable].copy_(self.wire.decode(body, trainable, dtype))
        self.frozen.decode(tail, rows[:, :tail.nbytes], out[:, trainable:])
        return out

    def invalidate(self):
        """The 16-bit shards may have changed: drop every secondary shard."""
        self._secondary.clear()

    def secondary_numel(self):
        """Elements (of the wire dtype) held in secondary shards now."""
        return sum(t.numel() for t in self._secondary.values())
