# SPDX-License-Identifier: Apache-2.0
"""Process topologies and the pipeline grid: upstream's names, as views of the one mesh.

A :class:`ProcessTopology` is a pure, row-major map between global ranks and named coordinates
(``axes=['pipe', 'data']``, ``dims=[2, 2]``: ranks 0 and 1 are stage 0). It creates nothing.
:class:`PipelineParallelGrid` turns a topology into the run's mesh (:func:`mesh_description`,
``deepspeed.utils.groups``): the pipe, data and model axes become the mesh's pipeline, data and
model (tensor) parallel groups, whatever the order of the axes (a column-major ``['data', 'pipe']``
topology lays the stages out differently, with the same groups). The grid's accessors read the mesh;
no group is created outside ``groups``.

Naming as upstream: the grid's *model-parallel* group is the pipe x model group of one data-parallel
replica (what checkpoints call ``mp_rank``); the *slice* (tensor) group is the model axis alone.
"""

from collections import namedtuple
from itertools import product

import deepspeed.comm as dist
from deepspeed.utils import groups

_KNOWN_AXES = ("pipe", "data", "model")


class ProcessTopology:
    """A map between global ranks and coordinates on named axes, row-major in the order of ``axes``.

    ``ProcessTopology(axes=['x', 'y'], dims=[2, 3])``: rank ``x * 3 + y`` has coordinate ``(x, y)``.
    """

    def __init__(self, axes, dims):
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {list(axes)} but {len(dims)} dims {list(dims)}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: repeated axis names in {list(axes)}")
        if any(int(d) < 1 for d in dims):
            raise ValueError(f"ProcessTopology: every dimension must be at least 1, got {list(dims)}")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self.mapping = {}
        self._coords = []
        for rank, values in enumerate(product(*(range(d) for d in self.dims))):
            coord = self.ProcessCoord(*values)
            self.mapping[coord] = rank
            self._coords.append(coord)

    def get_rank(self, **coord_kwargs):
        """The global rank at the coordinate given by every axis (``get_rank(pipe=1, data=0)``)."""
        if len(coord_kwargs) != len(self.axes):
            raise ValueError("get_rank() does not support slices. Use filter_match())")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"get_rank(): coordinate {coord_kwargs} is outside the topology {self}")
        return self.mapping[key]

    def get_axis_names(self):
        return self.axes

    def get_rank_repr(self, rank, omit_axes=["data", "pipe"], inner_sep="_", outer_sep="-"):
        """``'model_01'``: the coordinate of ``rank`` on the axes not omitted, as checkpoint names spell it."""
        omit = frozenset(omit_axes)
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in omit)

    def get_dim(self, axis):
        """The number of ranks along ``axis`` (0 when the topology has no such axis)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank):
        """The coordinate (a namedtuple with one field per axis) of global rank ``rank``."""
        if not 0 <= int(rank) < len(self._coords):
            raise ValueError(f"rank {rank} not found in topology.")
        return self._coords[int(rank)]

    def get_axis_comm_lists(self, axis):
        """The groups along ``axis``: for every coordinate of the other axes, the ranks that differ only on
        ``axis`` (in ``axis`` order); ``[]`` when the topology has no such axis."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values))
            lists.append([self.mapping[self.ProcessCoord(**fixed, **{axis: i})] for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs):
        """The ranks whose coordinates match every ``axis=value`` given, in rank order."""
        return [
            rank for rank, coord in enumerate(self._coords) if all(
                getattr(coord, axis) == value for axis, value in filter_kwargs.items())
        ]

    def get_axis_list(self, axis, idx):
        """The ranks whose coordinate on ``axis`` is ``idx``."""
        if axis not in self.axes:
            return []
        return self.filter_match(**{axis: idx})

    def world_size(self):
        size = 1
        for d in self.dims:
            size *= d
        return size

    def __str__(self):
        return str(dict(zip(self.axes, self.dims)))


def _prime_factors(N):
    """The prime factors of ``N`` in increasing order, with multiplicity (``12 -> [2, 2, 3]``)."""
    if N <= 0:
        raise ValueError("Values must be strictly positive.")
    primes, n, p = [], int(N), 2
    while p * p <= n:
        while n % p == 0:
            primes.append(p)
            n //= p
        p += 1
    if n > 1:
        primes.append(n)
    return primes


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism: axes ``['pipe', 'data']`` (a stage's data-parallel ranks are neighbours)."""

    def __init__(self, num_pp, num_dp):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallelism: axes ``['pipe', 'data', 'model']``."""

    def __init__(self, num_pp, num_mp, num_dp):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def _singletons(world):
    return tuple((r, ) for r in range(world))


def mesh_description(topology):
    """The :class:`~deepspeed.utils.groups.MeshDescription` of ``topology`` (pure: creates nothing).

    Raises ``ValueError`` (the same on every rank) for a topology whose axes are not among
    ``pipe``, ``data`` and ``model``.
    """
    unknown = [a for a in topology.get_axis_names() if a not in _KNOWN_AXES]
    if unknown:
        raise ValueError(f"topology axes {unknown} are not supported (the pipeline grid knows the axes "
                         f"{list(_KNOWN_AXES)})")
    world = topology.world_size()

    def table(axis):
        lists = topology.get_axis_comm_lists(axis)
        return tuple(tuple(ranks) for ranks in lists) if lists else _singletons(world)

    dp = table("data") if "data" in topology.get_axis_names() else _singletons(world)
    return groups.MeshDescription.from_tables(world,
                                              table("model"),
                                              _singletons(world),
                                              dp,
                                              dp,
                                              pp_table=table("pipe"))


def build_mesh(topology):
    """Make ``topology``'s mesh current (a collective on every rank unless it is current already)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if topology.world_size() != world:
        raise ValueError(f"the topology {topology} has {topology.world_size()} ranks, but the world has {world}; "
                         f"the product of its dimensions must be the number of processes")
    description = mesh_description(topology)
    current = groups._MESH
    if current is not None and current.description == description:
        return current
    return groups.build_mesh(description)


class PipelineParallelGrid:
    """Upstream's pipeline grid over ``topology`` (default: pipeline x data from the world's prime factors).

    Building it makes the topology's mesh current (a collective: every rank, same topology). The
    accessors read that mesh; ``process_group`` is accepted for upstream's signature (the world's
    default group is the only one supported).
    """

    def __init__(self, topology=None, process_group=None):
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        if topology is None:
            num_pp, num_dp = 1, 1
            for idx, prime in enumerate(_prime_factors(self.world_size)):
                if idx % 2 == 0:
                    num_pp *= prime
                else:
                    num_dp *= prime
            topology = PipeDataParallelTopology(num_pp=num_pp, num_dp=num_dp)
        self._topo = topology
        self._mesh = build_mesh(topology)
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()
        mesh = self._mesh
        self.dp_groups = [list(r) for r in (topology.get_axis_comm_lists("data") or _singletons(self.world_size))]
        self.dp_group = list(mesh.ranks("data_parallel"))
        self.pipe_groups = [list(r) for r in (topology.get_axis_comm_lists("pipe") or _singletons(self.world_size))]
        self.pp_group = list(mesh.ranks("pipe_parallel"))
        self.model_groups = [list(r) for r in mesh.description.model_parallel_ranks]
        self.slice_group = list(mesh.ranks("model_parallel"))
        self.mp_group = self.slice_group
        model_ranks = list(mesh.ranks("pipe_model_parallel"))
        self.ds_model_rank = model_ranks.index(self.global_rank)
        self.ds_model_world_size = len(model_ranks)
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.p2p_groups = self._build_p2p_groups()

    # Process groups are looked up in the mesh on each access (so a grid never keeps a destroyed group alive).
    @property
    def dp_proc_group(self):
        return self._mesh.group("data_parallel")

    @property
    def pp_proc_group(self):
        return self._mesh.group("pipe_parallel")

    @property
    def ds_model_proc_group(self):
        return self._mesh.group("pipe_model_parallel")

    @property
    def slice_proc_group(self):
        return self._mesh.group("model_parallel")

    def get_stage_id(self):
        coord = self._topo.get_coord(self.global_rank)
        return getattr(coord, "pipe", 0)

    def get_data_parallel_id(self):
        coord = self._topo.get_coord(self.global_rank)
        return getattr(coord, "data", 0)

    def _build_p2p_groups(self):
        """``[rank, its next stage's rank (the first stage after the last)]`` for every global rank."""
        pairs = []
        for rank in range(self.world_size):
            for ranks in self.pipe_groups:
                if rank in ranks:
                    pairs.append([rank, ranks[(ranks.index(rank) + 1) % len(ranks)]])
                    break
        return pairs

    def _is_grid_valid(self):
        return self._topo.world_size() == self.world_size

    def stage_to_global(self, stage_id, **kwargs):
        """The global rank of stage ``stage_id`` with this rank's other coordinates (overridden by ``kwargs``)."""
        me = self._topo.get_coord(self.global_rank)
        return self._topo.get_rank(**me._replace(pipe=stage_id, **kwargs)._asdict())

    def topology(self):
        return self._topo

    # MPU functions (upstream's names)
    def get_global_rank(self):
        return self.global_rank

    def get_pipe_parallel_rank(self):
        return self.get_stage_id()

    def get_pipeline_model_parallel_rank(self):
        return self.get_pipe_parallel_rank()

    def get_pipe_parallel_world_size(self):
        return self.pipe_parallel_size

    def get_pipeline_model_parallel_world_size(self):
        return self.get_pipe_parallel_world_size()

    def get_pipe_parallel_group(self):
        return self.pp_proc_group

    def get_data_parallel_rank(self):
        return self.data_parallel_id

    def get_data_parallel_world_size(self):
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self):
        return self.dp_group

    def get_model_parallel_rank(self):
        """This rank's index in the pipe x model group of its data-parallel replica."""
        return self.ds_model_rank

    def get_model_parallel_world_size(self):
        return self.ds_model_world_size

    def get_model_parallel_group(self):
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self):
        coord = self._topo.get_coord(self.global_rank)
        return getattr(coord, "model", 0)

    def get_tensor_model_parallel_rank(self):
        return self.get_slice_parallel_rank()

    def get_slice_parallel_world_size(self):
        return self.slice_parallel_size

    def get_tensor_model_parallel_world_size(self):
        return self.get_slice_parallel_world_size()

    def get_slice_parallel_group(self):
        return self.slice_proc_group

    def get_tensor_model_parallel_group(self):
        return self.slice_proc_group
