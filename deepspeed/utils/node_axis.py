# SPDX-License-Identifier: Apache-2.0
"""The node axis of the mesh: ZeRO++'s node-sized groups inside the ZeRO (sequence-data-parallel) groups.

ZeRO++ splits each group of ranks that ZeRO-3 shards over into *nodes* of ``h`` consecutive members
(``zero_optimization.zero_hpz_partition_size``), as the expert-parallel axis cuts the same groups into
runs of ``ep`` ranks:

* a node group joins ``h`` consecutive members (``[0, 1], [2, 3]`` for ``h = 2`` of world 4): the hpZ
  secondary shard lives there, and the backward all-gather of a ZeRO-3 unit stays inside it;
* a cross-node group joins the members at one position of every node (``[0, 2], [1, 3]``): the second
  hop of qgZ's hierarchical reduce-scatter.

Expert parameters of expert-parallel size > 1 are sharded over their expert-data-parallel groups instead; their
node axis is made of *sub-nodes*, the members of such a group inside one node (:func:`expert_node_size`,
:func:`build_expert_node_axis`): ``[0, 2] | [4, 6]`` for ep 2 and ``h = 4`` of world 8. Where a sub-node is one
rank (``h`` divides ep) or the sub-nodes differ in size, the expert groups have no node axis.

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
    node, cross_table = node_tables(zero_table, size)
    axis = _AXIS
    if axis is None or axis.size != size or getattr(axis, "_mesh", None) is not mesh:
        axis = _AXIS = _new_axis(node, cross_table, size, zero_world // size, mesh)
    return _with_cross(axis, cross_table, cross)


def _new_axis(node, cross_table, size, nodes, mesh):
    """The :class:`NodeAxis` of ``mesh``'s rank on the tables ``node`` / ``cross_table`` (builds the node groups)."""
    rank = mesh.rank
    node_ranks = next(r for r in node if rank in r)
    cross_ranks = next(r for r in cross_table if rank in r)
    axis = NodeAxis(size=size,
                    nodes=nodes,
                    node_rank=node_ranks.index(rank),
                    cross_rank=cross_ranks.index(rank),
                    node_ranks=node_ranks,
                    cross_ranks=cross_ranks,
                    node_group=_group(node),
                    cross_group=None)
    axis._mesh = mesh
    axis._has_cross = False
    return axis


def _with_cross(axis, cross_table, cross):
    """``axis``, with its cross-node group built where ``cross`` asks for it (once)."""
    if cross and not axis._has_cross:
        axis.cross_group = _group(cross_table)
        axis._has_cross = True
    return axis


def expert_node_size(expert_table, node_table):
    """The node size of hpZ / qgZ for the expert-data-parallel groups ``expert_table`` on the node axis
    ``node_table`` (both tables of global ranks, pure): each expert group's members inside one node form its
    *sub-node*, and where every sub-node of every group holds the same number ``h_e`` of consecutive members
    (runs of ``h_e`` in the group's order, so that :func:`node_tables` of the expert groups gives them), ``h_e``
    is returned; ``None`` where they differ (the sub-nodes are irregular). ``h_e = 1`` means every member of an
    expert group sits on a node of its own."""
    node_of = {r: i for i, ranks in enumerate(node_table) for r in ranks}
    size = None
    for ranks in expert_table:
        runs = []
        for r in ranks:
            if runs and node_of[runs[-1][-1]] == node_of[r]:
                runs[-1].append(r)
            else:
                runs.append([r])
        if len({node_of[run[0]] for run in runs}) != len(runs):  # a node's members are not consecutive
            return None
        lengths = {len(run) for run in runs}
        if len(lengths) != 1 or (size is not None and lengths != {size}):
            return None
        size = lengths.pop()
    return size


_EXPERT_AXES = {}


def build_expert_node_axis(group_name, h, cross=False):
    """This rank's :class:`NodeAxis` over the expert-data-parallel groups of expert group ``group_name``, for the
    ZeRO groups' node size ``h``: nodes are the sub-nodes of :func:`expert_node_size`. None where that size is 1
    (every member on another node) or irregular: then the expert units have no node axis (hpZ: the backward gather
    runs over the expert-data-parallel group, as the forward's; qgZ: one hop over it). A collective where it builds
    groups (every rank, same arguments, same order of group names)."""
    mesh = current_mesh()
    tables = dict(mesh.description.tables())
    zero_table = tables[ZERO_KIND]
    expert_table = tables[f"expert_data_parallel:{group_name}"]
    size = check_node_size(h, len(zero_table[0]))
    sub = expert_node_size(expert_table, node_tables(zero_table, size)[0])
    if sub is None or sub == 1:
        return None
    node, cross_table = node_tables(expert_table, sub)
    axis = _EXPERT_AXES.get((group_name, sub))
    if axis is None or getattr(axis, "_mesh", None) is not mesh:
        axis = _EXPERT_AXES[(group_name, sub)] = _new_axis(node, cross_table, sub, len(expert_table[0]) // sub, mesh)
    return _with_cross(axis, cross_table, cross)


def current_node_axis():
    """The node axis built last (None before any)."""
    return _AXIS


def forget_node_axis():
    global _AXIS
    _AXIS = None
    _EXPERT_AXES.clear()


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
