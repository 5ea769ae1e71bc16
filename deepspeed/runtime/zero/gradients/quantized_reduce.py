# SPDX-License-Identifier: Apache-2.0
"""qgZ: ZeRO-3's gradient reduce-scatter as quantized all-to-all hops (``zero_quantized_gradients``).

A transport of the gradient pipeline (``transport.py``): :meth:`QuantizedReduceScatter.reduce_scatter` takes the
unit's rank-major buffer (``W`` rows of ``C`` values, row ``d`` for destination rank ``d``) and leaves in
``output`` the sum over ranks of the rows for this rank, as an exact reduce-scatter would, but every value
on the wire is a 4-bit code of a symmetric block (``block_quant``: ``GRAD_BITS``, ``GRAD_BLOCK``).

The hops follow upstream's hierarchical scheme, over the mesh's node axis (``deepspeed.utils.node_axis``;
``h`` members a node, ``N`` nodes, rank ``(n, l)`` at position ``n * h + l`` of the ZeRO group):

1. inside the node: each rank quantizes, for every member ``l'`` of its node, the ``N`` rows whose
   destinations sit at position ``l'`` of some node, and exchanges them in one all-to-all; it dequantizes what
   it received and sums it over the ``h`` senders: ``N`` partial rows, one per node;
2. across nodes: it quantizes those ``N`` rows again and exchanges them with the members at its own position
   of every node (one all-to-all), dequantizes and sums over the ``N`` senders: its reduced row.

So each gradient element crosses the slow inter-node links once, in 4 bits, and a rank sends about
``C * W * (1/2 + 4/GRAD_BLOCK)`` bytes in the first hop and ``C * N * (1/2 + 4/GRAD_BLOCK)`` in the second,
against ``4 * C * W`` for an fp32 reduce-scatter. With no node axis, or one node, or nodes of one rank, a
single all-to-all over the ZeRO group does it. Unlike upstream, which quantizes only across several nodes,
the gradients are quantized whenever the key is set: what the config asks for is what runs.

Expert units of expert-parallel size > 1 are reduced over their expert-data-parallel group by an instance of
their own (its size, and its sub-nodes of the node axis: ``node_axis.build_expert_node_axis``), chosen by group
(``transport.GroupTransports``).

The sums over senders run in rank order in float32 on every rank, so the result is deterministic. The
collectives are recorded by the comms logger as ``all_to_all_single:qgZ`` (one hop),
``all_to_all_single:qgZ:node`` and ``all_to_all_single:qgZ:cross_node``.
"""

import os

import torch

import deepspeed.comm as dist
from deepspeed.runtime.zero.gradients import block_quant
from deepspeed.runtime.zero.gradients.transport import CommTransport


class QuantizedReduceScatter(CommTransport):
    """qgZ's reduce-scatter (module docstring); ``all_reduce`` and ``all_gather`` stay exact."""

    def __init__(self, world_size, node_axis=None, bits=block_quant.GRAD_BITS, block=block_quant.GRAD_BLOCK):
        super().__init__()
        self.world_size = int(world_size)
        self.bits = bits
        self.block = block
        two_hops = node_axis is not None and 1 < node_axis.size < self.world_size
        self.node_axis = node_axis if two_hops else None

    def reduce_scatter(self, output, input, group):
        world, numel = self.world_size, output.numel()
        rows = input.view(world, numel)
        axis = self.node_axis
        if axis is None:
            reduced = self._hop(rows, world, group, "qgZ")
        else:
            h, nodes = axis.size, axis.nodes
            # destinations (n', l') -> sent to member l' of this node, its N rows in node order
            by_member = rows.view(nodes, h, numel).transpose(0, 1).reshape(h * nodes, numel)
            partial = self._hop(by_member, h, axis.node_group, "qgZ:node")
            reduced = self._hop(partial, nodes, axis.cross_group, "qgZ:cross_node")
        output.copy_(reduced.view(-1))
        return None

    def _hop(self, rows, peers, group, label):
        """One quantized all-to-all: ``rows`` are ``peers`` equal runs (run ``i`` for peer ``i``); returns the
        dequantized runs received, summed over the senders (float32)."""
        numel = rows.shape[1]
        packed = block_quant.quantize_rows(rows, self.bits, self.block)
        received = torch.empty_like(packed)
        dist.all_to_all_single(received, packed, group=group, log_name=f"all_to_all_single:{label}")
        values = torch.empty(rows.shape[0], numel, dtype=torch.float32, device=rows.device)
        block_quant.dequantize_rows(received, numel, self.bits, self.block, values)
        return values.view(peers, -1, numel).sum(dim=0)


def qgz_node_size(zero_world_size):
    """The node size of qgZ's first hop without hpZ (whose nodes it uses otherwise): the ranks of one host
    (``LOCAL_WORLD_SIZE``) where the ZeRO group is the world and they split it into several nodes; else 1 (one
    hop)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if 1 < local < zero_world_size and zero_world_size % local == 0:
        return local
    return 1
