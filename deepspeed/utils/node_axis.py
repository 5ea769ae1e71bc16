# SPDX-License-Identifier: Apache-2.0
"""The node axis of the mesh: ZeRO++'s node-sized groups inside the ZeRO (sequence-data-parallel) groups.

ZeRO++ splits each group of ranks that ZeRO-3 shards over into *nodes* of ``h`` consecutive members
(``zero_optimization.zero_hpz_partition_size``), as the expert-parallel axis cuts the same groups into
runs of ``ep`` ranks:

* a node group joins ``h`` consecutive members (``[0, 1], [2, 3]`` for ``h = 2`` of world 4): the hpZ
  secondary shard lives there, and the backward all-gather of a ZeRO-3 unit stays inside it;
* a cross-node group joins the members at one position of every node (``[0, 2], [1, 3]``): the second
  hop of qgZ's hierarchical reduce-scatter.

Without an mpu and with no sequence or tensor parallelism the ZeRO group is the world and the node groups
are upstream's ``_create_zero_param_parallel_group`` groups (``h`` consecutive global ranks). As upstream,
``h`` is capped at the ZeRO group's size and must then divide it.

:func:`node_tables` is pure (the same tables on every rank, no collective); :func:`build_node_axis` creates
the groups through :func:`deepspeed.utils.mesh.group_of_ranks` (a collective: every rank, same ``h``).
``deepspeed.utils.groups`` exposes upstream's accessor names for it (``_get_zero_param_intra_parallel_group``
...). This module imports only ``deepspeed.comm`` and ``deepspeed.utils.mesh``.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import deepspeed.comm as dist
from deepspeed.utils.mesh import current_mesh, group_of_ranks

ZERO_KIND = "sequence_data_parallel"  # the groups ZeRO shards over (engine_parts.mesh.dense_group)


def effective_node_size(h, zero_world_size):
    """The node size ``zero_hpz_partition_size = h`` gives over a ZeRO group of ``zero_world_size`` ranks (upstream
    caps it at the group's size); 1 means no node axis."""
    return max(1, min(int(h), int(zero_world_size)))


def check_node_size(h, zero_world_size, key="zero_optimization.zero_hpz_partition_size"):
    """Raise ValueError naming ``key`` unless the node size divides the ZeRO group (pure: no collective)."""
    size = effective_node_size(h, zero_world_size)
    if zero_world_size % size != 0:
        raise ValueError(f"config key '{key}' = {h}: the {zero_world_size} ranks that ZeRO shards over do not split "
                         f"into nodes of {size} ranks (the size must divide the data-parallel world size)")
    return size


def node_tables(zero_table, h):
    """``(node table, cross-node table)``: each ZeRO group cut into runs of ``h`` consecutive members, and the
    members at one position of every run (module docstring). Pure."""
    node = tuple(tuple(ranks[i:i + h]) for ranks in zero_table for i in range(0, len(ranks), h))
    cross = tuple(tuple(ranks[j::h]) for ranks in zero_table for j in range(h))
    return node, cross


@dataclass
class NodeAxis:
    """This rank's place on the node axis: ``size`` members a node, ``nodes`` nodes a ZeRO group.

    ``node_rank`` is the rank's position in its node group (``0 .. size - 1``), ``cross_rank`` its node's index
    (its position in its cross-node group). ``node_group`` / ``cross_group`` are process groups (None where
    the group is this rank alone; the default group stands as ``torch.distributed.group.WORLD``).
    """
    size: int
    nodes: int
    node_rank: int
    cross_rank: int
    node_ranks: Tuple[int, ...]
    cross_ranks: Tuple[int, ...]
    node_group: Optional[object]
    cross_group: Optional[object]


_AXIS: Optional[NodeAxis] = None


def _group(table):
    """This rank's group of ``table`` (a collective), or None for groups of one rank (never communicated over)."""
    if len(table[0]) == 1 or not dist.is_initialized():
        return None
    return group_of_ranks(table)


def build_node_axis(h, cross=False):
    """Create (once per mesh and size) and return this rank's :class:`NodeAxis` for node size ``h`` (capped at the
    ZeRO group's size; ValueError if it does not divide it). ``cross``: the cross-node groups too (qgZ's second
    hop; hpZ alone needs only the node groups). A collective: every rank calls it with the same arguments."""
    global _AXIS
    mesh = current_mesh()
    zero_table = dict(mesh.description.tables())[ZERO_KIND]
    zero_world = len(zero_table[0])
    size = check_node_size(h, zero_world)
    rank = mesh.rank
    node, cross_table = node_tables(zero_table, size)
    axis = _AXIS
    if axis is None or axis.size != size or getattr(axis, "_mesh", None) is not mesh:
        node_ranks = next(r for r in node if rank in r)
        cross_ranks = next(r for r in cross_table if rank in r)
        axis = NodeAxis(size=size,
                        nodes=zero_world // size,
                        node_rank=node_ranks.index(rank),
                        cross_rank=cross_ranks.index(rank),
                        node_ranks=node_ranks,
                        cross_ranks=cross_ranks,
                        node_group=_group(node),
                        cross_group=None)
        axis._mesh = mesh
        axis._has_cross = False
        _AXIS = axis
    if cross and not axis._has_cross:
        axis.cross_group = _group(cross_table)
        axis._has_cross = True
    return axis


def current_node_axis():
    """The node axis built last (None before any)."""
    return _AXIS


def forget_node_axis():
    global _AXIS
    _AXIS = None


# ------------------------------------------------------------------ upstream's accessor names
def _create_zero_param_parallel_group(group_size):
    """Build the node groups of ``group_size`` ranks (upstream's name; a collective)."""
    return build_node_axis(group_size).node_group


def _get_zero_param_intra_parallel_group():
    """This rank's node group (None before one was built, as upstream)."""
    return None if _AXIS is None else _AXIS.node_group


def _zero_param_parallel_is_initialized():
    return _AXIS is not None


def _get_zero_param_intra_parallel_rank_in_mygroup():
    return 0 if _AXIS is None else _AXIS.node_rank


def _get_zero_param_intra_parallel_group_world_size():
    return 1 if _AXIS is None else _AXIS.size


def _get_zero_param_intra_parallel_group_ranks():
    if _AXIS is None:
        return [dist.get_rank() if dist.is_initialized() else 0]
    return list(_AXIS.node_ranks)
