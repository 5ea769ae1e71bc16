# SPDX-License-Identifier: Apache-2.0
"""Upstream's accessors of the process groups, over the mesh of :mod:`deepspeed.utils.mesh`.

The accessors keep upstream's names (``_get_data_parallel_group``, ``_get_expert_data_parallel_group(name)``,
``_get_sequence_parallel_world_size`` ...), as do ``initialize``, ``_create_expert_and_data_parallel`` and
``_get_expert_parallel_ranks``. Before any mesh is built they describe the default mesh: every rank one
data-parallel replica, no sequence, model or expert parallelism. The mesh's own names (``MeshDescription``,
``initialize_mesh``, ``current_mesh`` ...) are importable from here too; ``_MESH`` and ``mpu`` read the mesh's
current state.
"""

from deepspeed.utils import mesh as _mesh_state
from deepspeed.utils.mesh import (  # noqa: F401  (the mesh's names, importable here as before)
    EXPERT_GROUP_PREFIX, expert_group_name, MeshError, _ensure_divisibility, Table, _check_table, MeshDescription,
    _expert_tables, _row_of, _joined, _WORLD, _Single, _Mesh, _GROUP_CACHE, _CACHE_OWNER, _current_cache, _new_group,
    build_mesh, group_of_ranks, _ranks_of_group, _gather_json, mpu_groups, describe_mpu, initialize_mesh,
    _mpu_sequence_data_parallel_size, _default_device, current_mesh, reset_mesh, forget_groups)


def __getattr__(name):
    # The mesh's mutable state lives in deepspeed.utils.mesh; read through, so that it is never a stale copy.
    if name in ("_MESH", "mpu"):
        return getattr(_mesh_state, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def initialize(ep_size=1, mpu=None):
    """Build the mesh with expert groups of ``ep_size`` (upstream's signature; a collective on every rank)."""
    mesh = _mesh_state._MESH
    keep = mesh is not None and mpu is None  # the current mesh's axes stay
    sp = mesh.description.sequence_parallel_size if keep else None
    sizes = set(mesh.description.expert_parallel_sizes) if mesh is not None else set()
    return initialize_mesh(sequence_parallel_size=sp,
                           expert_parallel_sizes=sorted(sizes | {int(ep_size)}),
                           mpu=mpu,
                           pipe_parallel_size=mesh.description.pipe_parallel_size if keep else 1,
                           model_parallel_size=mesh.description.model_parallel_size if keep else 1)


def _create_expert_and_data_parallel(expert_parallel_size_,
                                     mp_size=None,
                                     pp_size=None,
                                     mp_mode="tp",
                                     use_data_before_expert_parallel_=False,
                                     folding_spec=None):
    """Add the expert and expert-data-parallel groups of ``expert_parallel_size_`` to the mesh (collective)."""
    if (mp_size or 1) > 1 or (pp_size or 1) > 1 or use_data_before_expert_parallel_ or folding_spec is not None:
        raise NotImplementedError("expert groups over tensor or pipeline parallelism, or with data before expert "
                                  "parallelism, are not supported; see docs/compatibility.md")
    mesh = current_mesh()
    if int(expert_parallel_size_) in mesh.description.expert_parallel_sizes:
        return mesh
    description = mesh.description.with_expert_sizes([expert_parallel_size_])
    given = {k: mesh.groups[k] for k, _ in mesh.description.tables() if k in mesh.groups}
    return build_mesh(description, given)


def _get_expert_parallel_ranks(world_size,
                               tensor_parallel_size_,
                               expert_parallel_size_,
                               pipeline_parallel_size_=1,
                               use_data_before_expert_parallel_=False):
    """Upstream's pure helper: ``(expert_parallel_groups, expert_data_parallel_groups)``, lists of global ranks in
    upstream's order, for the standard layout (pipeline stages of ``world_size / pp`` consecutive ranks, tensor
    parallelism innermost). The same tables the mesh builds; :class:`MeshError` if the sizes do not fit."""
    if use_data_before_expert_parallel_:
        raise NotImplementedError("use_data_before_expert_parallelism (data before expert parallelism) is not "
                                  "supported; see docs/compatibility.md")
    pp, tp, ep = int(pipeline_parallel_size_), int(tensor_parallel_size_), int(expert_parallel_size_)
    _ensure_divisibility(world_size, tp * pp)
    _ensure_divisibility(world_size // (tp * pp), ep)
    stage = world_size // pp
    spdp = MeshDescription.standard(stage, model_parallel_size=tp).sequence_data_parallel_ranks
    ep_groups, edp_groups = [], []
    for offset in range(0, world_size, stage):
        shifted = [[offset + r for r in ranks] for ranks in spdp]
        ep_table, edp_table = _expert_tables(shifted, ep)
        ep_groups += [list(g) for g in ep_table]
        edp_groups += [list(g) for g in edp_table]
    return ep_groups, edp_groups


# ------------------------------------------------------------------ accessors (upstream's names)
def _group(kind):
    return current_mesh().group(kind)


def _size(kind):
    return len(current_mesh().ranks(kind))


def _index(kind):
    mesh = current_mesh()
    return mesh.ranks(kind).index(mesh.rank)


def _expert_kind(prefix, group_name):
    mesh = current_mesh()
    kind = f"{prefix}:{group_name}"
    if kind not in mesh.groups:
        raise KeyError(f"expert parallel group '{group_name}' is not initialized (groups: "
                       f"{mesh.description.group_names()}); build the engine with the MoE model first")
    return kind


def _get_data_parallel_group():
    return _group("data_parallel")


def _get_data_parallel_world_size():
    return _size("data_parallel")


def _get_data_parallel_rank():
    return _index("data_parallel")


def _get_data_parallel_group_ranks():
    return list(current_mesh().ranks("data_parallel"))


def _get_broadcast_src_rank():
    """The global rank that dense parameters are broadcast from: the first of this rank's sequence-data group."""
    return current_mesh().ranks("sequence_data_parallel")[0]


def _get_model_parallel_group():
    return _group("model_parallel")


def _get_model_parallel_world_size():
    return _size("model_parallel")


def _get_model_parallel_rank():
    return _index("model_parallel")


def _get_pipe_parallel_group():
    """The group of this rank's peers in the other pipeline stages (same data, sequence and model index)."""
    return _group("pipe_parallel")


def _get_pipe_parallel_world_size():
    return _size("pipe_parallel")


def _get_pipe_parallel_rank():
    return _index("pipe_parallel")


def _get_pipe_model_parallel_group():
    """The pipeline x model (tensor) group of one data-parallel replica (upstream's grid: model parallel)."""
    return _group("pipe_model_parallel")


def _get_pipe_model_parallel_world_size():
    return _size("pipe_model_parallel")


def _get_pipe_model_parallel_rank():
    return _index("pipe_model_parallel")


def _get_model_data_parallel_group():
    """Every rank of this rank's pipeline stage (sequence-data x model parallel)."""
    return _group("model_data_parallel")


def _get_model_data_parallel_world_size():
    return _size("model_data_parallel")


def _get_model_data_parallel_rank():
    return _index("model_data_parallel")


# Tensor parallelism: upstream's public accessors (the model-parallel axis of the mesh is the tensor axis).
def get_tensor_model_parallel_group():
    return _group("model_parallel")


def get_tensor_model_parallel_world_size():
    return _size("model_parallel")


def get_tensor_model_parallel_rank():
    return _index("model_parallel")


def get_tensor_model_parallel_src_rank():
    """The global rank of the first member of this rank's tensor-parallel group."""
    return current_mesh().ranks("model_parallel")[0]


def get_model_parallel_group():
    return _group("model_parallel")


def get_model_parallel_world_size():
    return _size("model_parallel")


def get_model_parallel_rank():
    return _index("model_parallel")


def get_data_parallel_group():
    return _group("data_parallel")


def get_data_parallel_world_size():
    return _size("data_parallel")


def get_data_parallel_rank():
    return _index("data_parallel")


def _get_sequence_parallel_group():
    return _group("sequence_parallel")


def _get_sequence_parallel_world_size():
    return _size("sequence_parallel")


def _get_sequence_parallel_rank():
    return _index("sequence_parallel")


def _get_sequence_data_parallel_group():
    return _group("sequence_data_parallel")


def _get_sequence_data_parallel_world_size():
    return _size("sequence_data_parallel")


def _get_sequence_data_parallel_rank():
    return _index("sequence_data_parallel")


def _get_expert_parallel_group(group_name):
    return _group(_expert_kind("expert_parallel", group_name))


def _get_expert_parallel_group_ranks(group_name):
    return list(current_mesh().ranks(_expert_kind("expert_parallel", group_name)))


def _get_expert_parallel_world_size(group_name):
    return _size(_expert_kind("expert_parallel", group_name))


def _get_expert_parallel_rank(group_name):
    return _index(_expert_kind("expert_parallel", group_name))


def _get_expert_parallel_src_rank(group_name):
    return current_mesh().ranks(_expert_kind("expert_parallel", group_name))[0]


def _get_expert_data_parallel_group(group_name):
    return _group(_expert_kind("expert_data_parallel", group_name))


def _get_expert_data_parallel_group_ranks(group_name):
    return list(current_mesh().ranks(_expert_kind("expert_data_parallel", group_name)))


def _get_expert_data_parallel_world_size(group_name):
    return _size(_expert_kind("expert_data_parallel", group_name))


def _get_expert_data_parallel_rank(group_name):
    return _index(_expert_kind("expert_data_parallel", group_name))


def _get_expert_broadcast_src_rank(group_name):
    """The global rank expert parameters of ``group_name`` are broadcast from: the first of the edp group."""
    return current_mesh().ranks(_expert_kind("expert_data_parallel", group_name))[0]


def _get_expert_parallel_group_dict():
    mesh = current_mesh()
    return {name: mesh.group(f"expert_parallel:{name}") for name in mesh.description.group_names()}


def _get_expert_data_parallel_group_dict():
    mesh = current_mesh()
    return {name: mesh.group(f"expert_data_parallel:{name}") for name in mesh.description.group_names()}


def _get_max_expert_size():
    """The largest expert-parallel size of the mesh (None without expert groups)."""
    sizes = current_mesh().description.expert_parallel_sizes
    return max(sizes) if sizes else None


def _get_max_expert_size_name():
    return expert_group_name(_get_max_expert_size())


def _get_max_expert_parallel_group():
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_model_parallel_world_size():
    return 1


# ZeRO++'s node axis (hpZ's secondary partition groups, qgZ's two hops) lives in node_axis.py, built from this mesh.
from deepspeed.utils.node_axis import (  # noqa: E402,F401
    _create_zero_param_parallel_group, _get_zero_param_intra_parallel_group,
    _get_zero_param_intra_parallel_group_ranks, _get_zero_param_intra_parallel_group_world_size,
    _get_zero_param_intra_parallel_rank_in_mygroup, _zero_param_parallel_is_initialized)
