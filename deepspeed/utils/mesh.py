# SPDX-License-Identifier: Apache-2.0
"""The mesh: one description of how ranks are laid out, and every process group built from it.

Nothing else in the package creates process groups. :class:`MeshDescription` is a frozen,
pure description (world size, pipeline-, model- (tensor-), sequence- and expert-parallel sizes,
and the rank tables derived from them); :func:`initialize_mesh` builds it once at
``deepspeed.initialize`` from the config's ``sequence_parallel_size``, the pipeline and
tensor-parallel sizes, an ``mpu`` and the MoE layers' ``ep_size``, and creates its groups.
Every rank builds the same description and calls ``torch.distributed.new_group`` for every
group of it in the same order, so group creation never pairs mismatched collectives.

Rank layout (the standard one, without an ``mpu``)::

    rank = ((pp_index * data_parallel_size + dp_index) * sequence_parallel_size + sp_index)
           * model_parallel_size + mp_index

The pipeline axis is outermost and the model (tensor) axis innermost, as upstream's
``PipeModelDataParallelTopology`` (axes ``pipe, data, model``) lays them out:

* model-parallel (tensor-parallel) groups are contiguous blocks of ``model_parallel_size``
  ranks (``[0, 1], [2, 3]`` for tensor-parallel size 2 of world 4);
* pipeline-parallel groups join the ranks with the same data, sequence and model index, one
  per stage (``[0, 2], [1, 3]`` for 2 stages of world 4); the pipe-model-parallel group joins
  the pipeline and model groups of one data-parallel replica (upstream's grid calls it the
  model-parallel group: what checkpoints name ``mp_rank``);
* sequence-parallel groups are contiguous within one model-parallel slot: ``[0, 1], [2, 3]``
  for sequence-parallel size 2 of world 4;
* data-parallel groups join the ranks with the same sequence- and model-parallel index
  (``[0, 2], [1, 3]`` there); the sequence-data-parallel group joins every rank of one
  model-parallel index (every rank that saw different tokens: the whole world when
  ``model_parallel_size`` is 1);
* the model-data-parallel group joins the sequence-data-parallel groups of every model-parallel
  index: all the ranks of one pipeline stage (the whole world without pipeline parallelism),
  over which a tensor-parallel model's replicated parameters are reduced;
* every other group lies within one pipeline stage;
* expert-parallel groups of size ``ep`` are contiguous runs of each sequence-data-parallel
  group (``[0, 1], [2, 3]`` for ep 2 of world 4) and the expert-data-parallel groups stride
  across them (``[0, 2], [1, 3]``): the ranks holding the same experts. Each expert group
  is named ``ep_size_<ep>``, as upstream names it.

With an ``mpu`` the data, model, sequence and sequence-data-parallel groups are the mpu's
own; their rank tables are gathered once (one small all-gather) so that every rank knows
every group and builds the expert groups the same way.

This module holds the description, its construction and the built mesh's state (the current mesh, the
group cache, the ``mpu`` given); :mod:`deepspeed.utils.groups` holds upstream's accessor names over it.
It imports only ``deepspeed.comm`` and registers :func:`forget_groups` with ``deepspeed.comm`` so that
``destroy_process_group()`` drops the groups without importing this module.
"""

import json
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

import deepspeed.comm as dist
from deepspeed.comm.lifecycle import on_world_destroyed

EXPERT_GROUP_PREFIX = "ep_size_"


def expert_group_name(ep_size):
    """The name upstream gives the expert groups of expert-parallel size ``ep_size``."""
    return f"{EXPERT_GROUP_PREFIX}{int(ep_size)}"


class MeshError(ValueError):
    """A mesh that cannot be laid out over the world (raised on every rank before any collective)."""


def _ensure_divisibility(numerator, denominator):
    """Raise :class:`MeshError` unless ``denominator`` divides ``numerator``."""
    if denominator < 1 or numerator % denominator != 0:
        raise MeshError(f"{numerator} is not divisible by {denominator}")


Table = Tuple[Tuple[int, ...], ...]


def _check_table(kind, table, world_size):
    seen = sorted(r for ranks in table for r in ranks)
    if seen != list(range(world_size)):
        raise MeshError(f"the {kind} groups {[list(r) for r in table]} do not cover every rank of the world "
                        f"({world_size}) exactly once")
    sizes = {len(ranks) for ranks in table}
    if len(sizes) != 1:
        raise MeshError(f"the {kind} groups {[list(r) for r in table]} have different sizes")


@dataclass(frozen=True)
class MeshDescription:
    """How the ranks are laid out (module docstring). Pure: building one issues no collective.

    ``expert_parallel_sizes`` holds the distinct expert-parallel sizes, sorted. The rank tables
    list every group of a kind (sorted tuples of global ranks, sorted); the expert tables are
    derived from ``sequence_data_parallel_ranks``, the pipe-model-parallel table from the
    pipeline and model tables.
    """
    world_size: int
    model_parallel_size: int = 1
    sequence_parallel_size: int = 1
    expert_parallel_sizes: Tuple[int, ...] = ()
    model_parallel_ranks: Table = ()
    sequence_parallel_ranks: Table = ()
    data_parallel_ranks: Table = ()
    sequence_data_parallel_ranks: Table = ()
    from_mpu: bool = False
    pipe_parallel_size: int = 1
    pipe_parallel_ranks: Table = ()
    pipe_model_parallel_ranks: Table = ()
    model_data_parallel_ranks: Table = ()  # every rank of one pipeline stage: sequence-data x model parallel
    expert_tables: Dict[str, Tuple[Table, Table]] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------ building
    @classmethod
    def standard(cls,
                 world_size,
                 *,
                 model_parallel_size=1,
                 sequence_parallel_size=1,
                 expert_parallel_sizes=(),
                 pipe_parallel_size=1):
        """The standard layout of the module docstring; :class:`MeshError` if the sizes do not fit the world."""
        world_size, mp, sp, pp = int(world_size), int(model_parallel_size), int(sequence_parallel_size), int(
            pipe_parallel_size)
        if world_size < 1 or mp < 1 or sp < 1 or pp < 1:
            raise MeshError(f"mesh sizes must be positive: world {world_size}, pipeline parallel {pp}, model "
                            f"parallel {mp}, sequence parallel {sp}")
        if world_size % (pp * mp * sp) != 0:
            raise MeshError(f"the world size ({world_size}) is not divisible by pipeline parallel size ({pp}) x "
                            f"model parallel size ({mp}) x sequence_parallel_size ({sp})")
        dp = world_size // (pp * mp * sp)
        coords = [(p, d, s, m) for p in range(pp) for d in range(dp) for s in range(sp) for m in range(mp)]

        def rank(p, d, s, m):
            return ((p * dp + d) * sp + s) * mp + m

        def table(same):
            """Groups of the ranks whose coordinates agree where ``same(coord)`` does."""
            rows = {}
            for c in coords:
                rows.setdefault(same(c), []).append(rank(*c))
            return tuple(tuple(ranks) for ranks in rows.values())

        mp_table = table(lambda c: (c[0], c[1], c[2]))
        sp_table = table(lambda c: (c[0], c[1], c[3]))
        dp_table = table(lambda c: (c[0], c[2], c[3]))
        spdp_table = table(lambda c: (c[0], c[3]))
        pp_table = table(lambda c: (c[1], c[2], c[3]))
        return cls.from_tables(world_size,
                               mp_table,
                               sp_table,
                               dp_table,
                               spdp_table,
                               expert_parallel_sizes,
                               pp_table=pp_table)

    @classmethod
    def from_tables(cls,
                    world_size,
                    mp_table,
                    sp_table,
                    dp_table,
                    spdp_table,
                    expert_parallel_sizes=(),
                    from_mpu=False,
                    pp_table=None):
        """A description from explicit rank tables (an mpu's or a topology's); checked, the expert and
        pipe-model tables derived. ``pp_table`` None: no pipeline parallelism (every rank its own stage group)."""
        if pp_table is None:
            pp_table = tuple((r, ) for r in range(world_size))
        tables = [
            tuple(sorted(tuple(sorted(int(r) for r in ranks)) for ranks in table))
            for table in (mp_table, sp_table, dp_table, spdp_table, pp_table)
        ]
        for kind, table in zip(
            ("model-parallel", "sequence-parallel", "data-parallel", "sequence-data-parallel", "pipeline-parallel"),
                tables):
            _check_table(kind, table, world_size)
        mp, sp, dp, spdp, pp = (len(t[0]) for t in tables)
        if pp * mp * sp * dp != world_size or sp * dp != spdp:
            raise MeshError(f"inconsistent mesh: pipeline parallel {pp} x model parallel {mp} x sequence parallel "
                            f"{sp} x data parallel {dp} must be the world size ({world_size}), sequence x data "
                            f"parallel the sequence-data-parallel size ({spdp})")
        pmp_table = _joined(tables[4], tables[0], world_size)
        if pmp_table is None or any(len(ranks) != pp * mp for ranks in pmp_table):
            raise MeshError(f"inconsistent mesh: the pipeline-parallel groups {[list(r) for r in tables[4]]} and the "
                            f"model-parallel groups {[list(r) for r in tables[0]]} do not form pipeline x model "
                            f"blocks of {pp * mp} ranks")
        mdp_table = _joined(tables[3], tables[0], world_size)
        if mdp_table is None or any(len(ranks) != spdp * mp for ranks in mdp_table):
            raise MeshError(f"inconsistent mesh: the sequence-data-parallel groups {[list(r) for r in tables[3]]} and "
                            f"the model-parallel groups {[list(r) for r in tables[0]]} do not form blocks of "
                            f"{spdp * mp} ranks")
        sizes = tuple(sorted({int(e) for e in expert_parallel_sizes}))
        experts = {}
        for ep in sizes:
            if ep < 1 or spdp % ep != 0:
                raise MeshError(f"expert-parallel size ep_size={ep} must divide the number of ranks that see "
                                f"different tokens ({spdp} = world {world_size} / model parallel {mp})")
            ep_table, edp_table = _expert_tables(tables[3], ep)
            experts[expert_group_name(ep)] = (tuple(sorted(ep_table)), tuple(sorted(edp_table)))
        return cls(world_size=world_size,
                   model_parallel_size=mp,
                   sequence_parallel_size=sp,
                   expert_parallel_sizes=sizes,
                   model_parallel_ranks=tables[0],
                   sequence_parallel_ranks=tables[1],
                   data_parallel_ranks=tables[2],
                   sequence_data_parallel_ranks=tables[3],
                   from_mpu=from_mpu,
                   pipe_parallel_size=pp,
                   pipe_parallel_ranks=tables[4],
                   pipe_model_parallel_ranks=pmp_table,
                   model_data_parallel_ranks=mdp_table,
                   expert_tables=experts)

    def with_expert_sizes(self, expert_parallel_sizes):
        """This mesh with expert groups for ``expert_parallel_sizes`` added."""
        sizes = set(self.expert_parallel_sizes) | {int(e) for e in expert_parallel_sizes}
        return MeshDescription.from_tables(self.world_size,
                                           self.model_parallel_ranks,
                                           self.sequence_parallel_ranks,
                                           self.data_parallel_ranks,
                                           self.sequence_data_parallel_ranks,
                                           sizes,
                                           self.from_mpu,
                                           pp_table=self.pipe_parallel_ranks)

    # ---------------------------------------------------------- derived
    @property
    def data_parallel_size(self):
        return self.world_size // (self.pipe_parallel_size * self.model_parallel_size * self.sequence_parallel_size)

    @property
    def sequence_data_parallel_size(self):
        return self.world_size // (self.pipe_parallel_size * self.model_parallel_size)

    def group_names(self):
        return sorted(self.expert_tables, key=lambda name: int(name[len(EXPERT_GROUP_PREFIX):]))

    def tables(self):
        """``[(kind, table)]`` in the order groups are created (the same on every rank)."""
        out = [("model_parallel", self.model_parallel_ranks), ("sequence_parallel", self.sequence_parallel_ranks),
               ("data_parallel", self.data_parallel_ranks),
               ("sequence_data_parallel", self.sequence_data_parallel_ranks),
               ("pipe_parallel", self.pipe_parallel_ranks), ("pipe_model_parallel", self.pipe_model_parallel_ranks),
               ("model_data_parallel", self.model_data_parallel_ranks)]
        for name in self.group_names():
            ep_table, edp_table = self.expert_tables[name]
            out.append((f"expert_parallel:{name}", ep_table))
            out.append((f"expert_data_parallel:{name}", edp_table))
        return out

    def ranks_of(self, kind, rank):
        """The group of ``kind`` (a :meth:`tables` kind) that ``rank`` belongs to, as a tuple of global ranks."""
        for k, table in self.tables():
            if k == kind:
                for ranks in table:
                    if rank in ranks:
                        return ranks
        raise KeyError(f"no {kind} group in this mesh")

    def coordinates(self, rank):
        """``{kind: index of rank inside its group of that kind}`` for every kind of group."""
        return {kind: self.ranks_of(kind, rank).index(rank) for kind, _ in self.tables()}

    def fingerprint(self):
        """A JSON-able summary every rank must agree on."""
        return [
            self.world_size, self.model_parallel_size, self.sequence_parallel_size,
            list(self.expert_parallel_sizes), self.pipe_parallel_size
        ]


def _expert_tables(sequence_data_parallel_table, ep):
    """``(expert-parallel, expert-data-parallel)`` tables of size-``ep`` expert groups, in construction order: each
    group of ranks that see different tokens is cut into consecutive expert-parallel groups of ``ep``; the ranks at
    one position of those form an expert-data-parallel group."""
    ep_table = tuple(
        tuple(ranks[i:i + ep]) for ranks in sequence_data_parallel_table for i in range(0, len(ranks), ep))
    edp_table = tuple(tuple(ranks[j::ep]) for ranks in sequence_data_parallel_table for j in range(ep))
    return ep_table, edp_table


def _row_of(table, rank):
    for ranks in table:
        if rank in ranks:
            return ranks
    raise KeyError(rank)


def _joined(table_a, table_b, world_size):
    """The groups each made of the ``table_b`` groups of one ``table_a`` group's members (None if they overlap)."""
    out = set()
    for ranks in table_a:
        out.add(tuple(sorted({r for a in ranks for r in _row_of(table_b, a)})))
    out = tuple(sorted(out))
    return out if sorted(r for ranks in out for r in ranks) == list(range(world_size)) else None


# ------------------------------------------------------------------ the built mesh
_WORLD = object()  # stands for the default (world) group in a mesh's table of groups


class _Single:
    """A group of this rank alone, created when first asked for (only its member takes part in creating it)."""

    __slots__ = ("rank", )

    def __init__(self, rank):
        self.rank = rank


class _Mesh:
    """A description and this rank's groups of every kind (group objects of torch.distributed)."""

    def __init__(self, description, rank, groups):
        self.description = description
        self.rank = rank
        self.groups = groups  # kind -> process group this rank belongs to (or a _Single not created yet)

    def group(self, kind):
        group = self.groups[kind]
        if group is _WORLD:  # looked up each time: holding the default group would keep it alive
            return torch.distributed.group.WORLD
        if isinstance(group, _Single):
            group = self.groups[kind] = _new_group((group.rank, ), self.description.world_size)
        return group

    def ranks(self, kind):
        return self.description.ranks_of(kind, self.rank)


_MESH: Optional[_Mesh] = None
_GROUP_CACHE = {}  # ranks tuple -> process group, valid for one default process group
_CACHE_OWNER = [None]
mpu = None  # the mpu given to initialize (upstream keeps it as a module global too)


def _current_cache():
    """The group cache, emptied when the default process group changed since it was filled."""
    default = id(torch.distributed.distributed_c10d._get_default_group())
    if _CACHE_OWNER[0] != default:
        _GROUP_CACHE.clear()
        _CACHE_OWNER[0] = default
    return _GROUP_CACHE


def _new_group(ranks, world_size):
    """The process group of ``ranks``: the world group when they are the world, else one created once.

    A group of one rank is created by that rank alone (``use_local_synchronization``), so it can be
    made on first use; the others are created by every rank, in the mesh's order.
    """
    if len(ranks) == world_size:
        return _WORLD
    group = _current_cache().get(ranks)
    if group is None:
        if len(ranks) == 1:
            group = torch.distributed.new_group(ranks=list(ranks), use_local_synchronization=True)
        else:
            group = dist.new_group(ranks=list(ranks))
        _GROUP_CACHE[ranks] = group
    return group


def build_mesh(description, given=None):
    """Create the groups of ``description`` (a collective: every rank, same description) and make it current.

    ``given`` maps kinds to groups that exist already (an mpu's): they are used, not created.
    """
    global _MESH
    given = given or {}
    rank = dist.get_rank() if dist.is_initialized() else 0
    groups = {}
    for kind, table in description.tables():
        if kind in given:
            groups[kind] = given[kind]
            continue
        for ranks in table:
            if not dist.is_initialized():
                groups[kind] = None
                continue
            if len(ranks) == 1 and description.world_size > 1:  # made on first use, by its member alone
                if rank in ranks:
                    groups[kind] = _GROUP_CACHE.get(ranks) or _Single(rank)
                continue
            group = _new_group(ranks, description.world_size)
            if rank in ranks:
                groups[kind] = group
    _MESH = _Mesh(description, rank, groups)
    return _MESH


def group_of_ranks(table, own=False):
    """This rank's group among ``table`` (groups of global ranks, the same list on every rank; a collective), or
    None when the rank is in none of them. For groups the mesh's axes do not describe (the stages that share a
    tied pipeline weight); each group is created once per default process group, like the mesh's own.

    ``own``: a group of its own even where the ranks are the whole world (pipeline transfers: their
    point-to-point messages then never share a communicator, nor its sequence, with the collectives).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = None
    for ranks in table:
        ranks = tuple(sorted(int(r) for r in ranks))
        if len(ranks) == 1:  # a group of one is made by its member alone
            if rank in ranks:
                mine = _new_group(ranks, world) if dist.is_initialized() else None
            continue
        if own and dist.is_initialized():
            key = ("own", ) + ranks
            group = _current_cache().get(key)
            if group is None:
                group = _GROUP_CACHE[key] = dist.new_group(ranks=list(ranks))
        else:
            group = _new_group(ranks, world)
        if rank in ranks:
            mine = group
    if mine is _WORLD:
        return torch.distributed.group.WORLD
    return mine


def _ranks_of_group(group):
    return tuple(sorted(torch.distributed.get_process_group_ranks(group)))


def _gather_json(obj, device):
    payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    world = dist.get_world_size()
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(lengths, length)
    lengths = lengths.tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[:payload.numel()] = payload.to(device)
    gathered = torch.empty(world * max(lengths), dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(gathered, padded)
    rows = gathered.cpu().view(world, -1)
    return [json.loads(bytes(rows[r, :lengths[r]].tolist()).decode()) for r in range(world)]


def mpu_groups(mpu_):
    """``{kind: group}`` for the groups an mpu provides (model, data, sequence, sequence-data parallel)."""
    found = {}
    getters = (("model_parallel", ("get_tensor_model_parallel_group",
                                   "get_model_parallel_group")), ("data_parallel", ("get_data_parallel_group", )),
               ("sequence_parallel", ("get_sequence_parallel_group", )), ("sequence_data_parallel",
                                                                          ("get_sequence_data_parallel_group", )),
               ("pipe_parallel", ("get_pipe_parallel_group", "get_pipeline_model_parallel_group")))
    for kind, names in getters:
        for name in names:
            fn = getattr(mpu_, name, None)
            if fn is not None:
                found[kind] = fn()
                break
    if "data_parallel" not in found and "sequence_data_parallel" not in found:
        raise MeshError(f"the mpu ({type(mpu_).__name__}) has neither get_data_parallel_group() nor "
                        f"get_sequence_data_parallel_group()")
    return found


def describe_mpu(mpu_, device, expert_parallel_sizes=()):
    """The description of an mpu's layout (one small all-gather of its rank tables) and the groups it gives."""
    found = mpu_groups(mpu_)
    world = dist.get_world_size()
    if "sequence_data_parallel" not in found:  # no sequence parallelism: every data-parallel rank sees new tokens
        found["sequence_data_parallel"] = found["data_parallel"]
    if "data_parallel" not in found:  # a sequence-parallel mpu (parallel_state_sp): data = sequence-data / sp
        found["data_parallel"] = None
    mine = {}
    for kind in ("model_parallel", "sequence_parallel", "data_parallel", "sequence_data_parallel", "pipe_parallel"):
        group = found.get(kind)
        mine[kind] = list(_ranks_of_group(group)) if group is not None else None
    everyone = _gather_json(mine, device)
    tables = {}
    for kind in mine:
        if any(entry[kind] is None for entry in everyone):
            tables[kind] = None
            continue
        tables[kind] = tuple(sorted({tuple(entry[kind]) for entry in everyone}))
    if tables["model_parallel"] is None:
        # Without a model-parallel group: each rank its own, unless the sequence-data groups (with the pipeline's)
        # leave ranks out.
        spdp = tables["sequence_data_parallel"]
        pp = len(tables["pipe_parallel"][0]) if tables["pipe_parallel"] is not None else 1
        mp = world // (len(spdp[0]) * pp)
        tables["model_parallel"] = tuple(tuple(sorted(ranks[i] for ranks in spdp))
                                         for i in range(len(spdp[0]))) if mp > 1 else tuple(
                                             (r, ) for r in range(world))
    if tables["sequence_parallel"] is None:
        tables["sequence_parallel"] = tuple((r, ) for r in range(world))
    if tables["data_parallel"] is None:
        # Ranks of one sequence-data group with the same position in their sequence-parallel group.
        sp_of = {r: ranks for ranks in tables["sequence_parallel"] for r in ranks}
        rows = {}
        for ranks in tables["sequence_data_parallel"]:
            for r in ranks:
                rows.setdefault((ranks, sp_of[r].index(r)), []).append(r)
        tables["data_parallel"] = tuple(sorted(tuple(sorted(v)) for v in rows.values()))
    description = MeshDescription.from_tables(world,
                                              tables["model_parallel"],
                                              tables["sequence_parallel"],
                                              tables["data_parallel"],
                                              tables["sequence_data_parallel"],
                                              expert_parallel_sizes,
                                              from_mpu=True,
                                              pp_table=tables["pipe_parallel"])
    # The mpu's groups are used as they are; kinds it does not give are created like any other group.
    return description, {kind: group for kind, group in found.items() if group is not None}


def initialize_mesh(*,
                    sequence_parallel_size=None,
                    expert_parallel_sizes=(),
                    mpu=None,
                    device=None,
                    pipe_parallel_size=1,
                    model_parallel_size=1):
    """Build and make current the mesh of this run (a collective: every rank, same arguments).

    ``sequence_parallel_size`` is the config's (None: 1, or the mpu's); ``expert_parallel_sizes``
    the MoE layers' ``ep_size`` values; ``mpu`` an object with ``get_data_parallel_group()`` /
    ``get_sequence_parallel_group()`` / ... (its groups are used as they are). Raises
    :class:`MeshError` on every rank, before any collective, when the sizes cannot be laid out
    (checked from the world size alone), or when the mpu's sequence-parallel size contradicts
    the config's. A current mesh with the same description is reused (its groups are not
    created again).
    """
    globals()["mpu"] = mpu
    world = dist.get_world_size() if dist.is_initialized() else 1
    sizes = tuple(int(e) for e in expert_parallel_sizes)
    if mpu is None:
        description = MeshDescription.standard(world,
                                               sequence_parallel_size=sequence_parallel_size or 1,
                                               expert_parallel_sizes=sizes,
                                               pipe_parallel_size=pipe_parallel_size,
                                               model_parallel_size=model_parallel_size)
        if _MESH is not None and _MESH.description == description:
            return _MESH
        return build_mesh(description)
    mpu_sp = int(mpu.get_sequence_parallel_world_size()) if hasattr(mpu, "get_sequence_parallel_world_size") else 1
    if sequence_parallel_size not in (None, mpu_sp):
        raise MeshError(f"config key 'sequence_parallel_size' ({sequence_parallel_size}) differs from the mpu's "
                        f"sequence-parallel world size ({mpu_sp})")
    for ep in sizes:  # checkable without a collective: the mpu's sizes are local facts
        spdp = _mpu_sequence_data_parallel_size(mpu)
        if ep < 1 or spdp % ep != 0:
            raise MeshError(f"expert-parallel size ep_size={ep} must divide the number of ranks that see different "
                            f"tokens ({spdp}, from the mpu)")
    if device is None:
        device = _default_device()
    description, given = describe_mpu(mpu, device, sizes)
    return build_mesh(description, given)


def _mpu_sequence_data_parallel_size(mpu_):
    if hasattr(mpu_, "get_sequence_data_parallel_world_size"):
        return int(mpu_.get_sequence_data_parallel_world_size())
    return int(mpu_.get_data_parallel_world_size())


def _default_device():
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def current_mesh():
    """The mesh built by the last :func:`initialize_mesh` (the default mesh of the world if none was built)."""
    if _MESH is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        return build_mesh(MeshDescription.standard(world))
    return _MESH


def reset_mesh():
    """Forget the current mesh (its groups stay cached for a mesh with the same ranks)."""
    global _MESH
    _MESH = None
    globals()["mpu"] = None


def forget_groups():
    """Drop every reference to the groups made here (``destroy_process_group`` calls it: a group kept alive
    keeps its communication threads running)."""
    reset_mesh()
    _GROUP_CACHE.clear()
    _CACHE_OWNER[0] = None


# deepspeed.comm.destroy_process_group() calls it: the groups made here must not outlive the default group.
on_world_destroyed(forget_groups)
