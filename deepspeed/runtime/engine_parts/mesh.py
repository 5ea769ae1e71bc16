# SPDX-License-Identifier: Apache-2.0
"""The engine's mesh: checked from the config, the ``mpu`` and the model, built once, and what follows from it.

:func:`check_mesh_inputs` runs on every rank before any collective and raises the same
error everywhere for a mesh that cannot be laid out (a sequence-parallel, tensor-parallel or
expert-parallel size that does not divide the world, an expert layer whose experts do not split
over its ``ep_size``, an ``mpu`` that reports tensor parallelism without its groups).
:func:`build_engine_mesh` then creates the groups (:mod:`deepspeed.utils.groups`),
:func:`reduction_plan` says over which group and with which divisor every parameter's
gradient is reduced (a tensor-parallel model's replicated parameters over the data- and
tensor-parallel ranks), and :func:`broadcast_model` starts
every rank from the same weights: dense parameters from the first rank of the
sequence-data-parallel group, expert parameters from the first rank of their
expert-data-parallel group (different expert-parallel ranks hold different experts).
"""

import dataclasses

import torch

import deepspeed.comm as dist
from deepspeed.moe.utils import expert_group_size, expert_parallel_sizes, is_moe_param
from deepspeed.runtime.sequence_parallel.loss import gradient_divisor
from deepspeed.runtime.tensor_parallel import replicated
from deepspeed.runtime.zero.gradients.reduction_spec import ReductionPlan, ReductionSpec
from deepspeed.runtime.zero.units.zeropp import check_zeropp
from deepspeed.utils import groups


def _mpu_model_parallel_size(mpu):
    for name in ("get_model_parallel_world_size", "get_tensor_model_parallel_world_size"):
        fn = getattr(mpu, name, None)
        if fn is not None:
            return int(fn())
    return 1


def sequence_parallel_size(config):
    """The config's ``sequence_parallel_size`` (None when not set)."""
    value = getattr(config, "sequence_parallel_size", None)
    return value if value is not None else config._param_dict.get("sequence_parallel_size")


def model_layout(model):
    """The mesh a model lays its ranks out on itself (a ``PipelineModule``'s stages), or None."""
    describe = getattr(type(model), "_mesh_description", None)
    return describe(model) if describe is not None else None


def model_key(model):
    """Which ranks hold the same model: the pipeline stage of a model that lays out its own ranks, else 0."""
    return int(getattr(model, "stage_id", 0)) if model_layout(model) is not None else 0


def mpu_model_parallel_size(mpu):
    """The tensor (model) parallel size an ``mpu`` reports (1 without one)."""
    return 1 if mpu is None else _mpu_model_parallel_size(mpu)


def check_mesh_inputs(config, model, mpu, model_parallel_size=1):
    """The expert-parallel sizes of ``model``; raises on every rank, before any collective, for a bad mesh.

    ``model_parallel_size``: the tensor-parallel size (``tensor_parallel.autotp_size``, or an mpu's).
    """
    layout = model_layout(model)
    if layout is not None and (sequence_parallel_size(config) or 1) > 1:
        raise NotImplementedError("sequence parallelism (config key 'sequence_parallel_size') together with "
                                  "pipeline parallelism is not supported; see docs/compatibility.md")
    if layout is not None and model_parallel_size > 1:
        raise NotImplementedError(f"tensor parallelism (size {model_parallel_size}) together with pipeline "
                                  f"parallelism is not supported; see docs/compatibility.md")
    mpu_mp = mpu_model_parallel_size(mpu)
    if mpu_mp > 1 and not any(
            hasattr(mpu, n) for n in ("get_model_parallel_group", "get_tensor_model_parallel_group")):
        raise ValueError(f"the mpu ({type(mpu).__name__}) reports model (tensor) parallel size {mpu_mp} but has no "
                         f"get_model_parallel_group() / get_tensor_model_parallel_group(): the tensor-parallel "
                         f"groups cannot be known")
    if mpu_mp > 1 and model_parallel_size not in (1, mpu_mp):
        raise ValueError(f"tensor_parallel.autotp_size ({model_parallel_size}) differs from the mpu's model-parallel "
                         f"size ({mpu_mp})")
    for module in model.modules():
        check = getattr(module, "check_expert_layout", None)
        if check is not None:
            check()
    sizes = expert_parallel_sizes(model)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if layout is not None:
        layout.with_expert_sizes(sizes)  # raises MeshError for experts that do not fit a stage
        zero_world = layout.sequence_data_parallel_size
    elif mpu is None:
        zero_world = groups.MeshDescription.standard(
            world,
            sequence_parallel_size=sequence_parallel_size(config) or 1,
            expert_parallel_sizes=sizes,
            model_parallel_size=model_parallel_size).sequence_data_parallel_size
    else:
        zero_world = groups._mpu_sequence_data_parallel_size(mpu)
    check_zeropp(config.zero_config, config.zero_optimization_stage, zero_world)  # ZeRO++'s node axis and keys
    return sizes


def build_engine_mesh(config, model, mpu, device, sizes, model_parallel_size=1):
    """Create the mesh's groups (a collective) and hand them to the model's MoE layers."""
    layout = model_layout(model)
    if layout is not None:  # the stages the model was cut into (its groups exist already)
        description = layout.with_expert_sizes(sizes) if sizes else layout
        current = groups._MESH
        mesh = current if current is not None and current.description == description else groups.build_mesh(
            description)
    else:
        mesh = groups.initialize_mesh(sequence_parallel_size=sequence_parallel_size(config),
                                      expert_parallel_sizes=sizes,
                                      mpu=mpu,
                                      device=device,
                                      model_parallel_size=model_parallel_size)
    for module in model.modules():
        setter = getattr(module, "set_deepspeed_parallelism", None)
        if setter is not None and callable(setter):
            setter()
    return mesh


def dense_group(mesh):
    """The group dense gradients are reduced over (None: the default group, when it is the whole world)."""
    ranks = mesh.ranks("sequence_data_parallel")
    return None if len(ranks) == mesh.description.world_size else mesh.group("sequence_data_parallel")


def _spec(mesh, kind, divisor, name):
    ranks = mesh.ranks(kind)
    # a group of one rank reduces nothing (and a world-wide one is the default group)
    group = None if len(ranks) in (1, mesh.description.world_size) else mesh.group(kind)
    return ReductionSpec(group=group, world_size=len(ranks), rank=ranks.index(mesh.rank), divisor=divisor, name=name)


def reduction_plan(mesh):
    """Per parameter, the group its gradient is reduced and partitioned over, and the mean's divisor.

    Dense parameters: over the sequence-data-parallel group (every rank that saw different
    tokens), divided by the data-parallel size times the sequence-parallel size (each rank of a
    sequence-parallel group backpropagates its group's whole loss); expert parameters of
    ``ep_size_<ep>``: over their expert-data-parallel group, divided by the same number. Either way
    the optimizer sees the mean over the global batch.
    """
    # Sequence parallelism's loss convention sets the divisor (docs/sequence_parallel.md): dp x sp.
    dp = gradient_divisor(mesh.description.data_parallel_size, mesh.description.sequence_parallel_size)
    dense = _spec(mesh, "sequence_data_parallel", dp, "dense")
    experts = {name: _spec(mesh, f"expert_data_parallel:{name}", dp, name) for name in mesh.description.group_names()}
    tp = mesh.description.model_parallel_size
    if tp == 1:
        return ReductionPlan(dense, experts)
    # Tensor parallelism (runtime/tensor_parallel/replicated.py): a replicated parameter is partitioned over the
    # data-parallel ranks like a cut one, and its gradient summed over the tensor-parallel ranks too (one all-reduce
    # over both for stage 0, the partition's chunk over the tensor group for stages 1-2, the shards once per window
    # for stage 3). A "mean" one computed its whole gradient on every tensor-parallel rank (tp replicas of it are
    # added up), a "sum" one its share. Each tensor-parallel rank's partitions then hold all of its parameters, so
    # its checkpoint files are complete by themselves.
    tp_group = _spec(mesh, "model_parallel", 1, "tensor").group
    union = _spec(mesh, "model_data_parallel", 1, "union").group
    tensor = {
        kind:
        dataclasses.replace(dense,
                            name=f"tensor_{kind}",
                            replicas=tp if kind == replicated.MEAN else 1,
                            tensor_group=tp_group,
                            tensor_size=tp,
                            union_group=union)
        for kind in (replicated.SUM, replicated.MEAN)
    }
    norm = _spec(mesh, "model_data_parallel", 1, "norm")
    return ReductionPlan(dense, experts, tensor, norm_group=norm.group, norm_size=norm.world_size)


@torch.no_grad()
def broadcast_model(module, mesh):
    """Start every rank from the same parameters and buffers (see the module docstring)."""
    if mesh.description.world_size == 1:
        return
    dense_src = groups._get_broadcast_src_rank()
    group = dense_group(mesh)
    for tensor in list(module.parameters()) + list(module.buffers()):
        if hasattr(tensor, "ds_id"):  # ZeRO-3 shards differ by rank on purpose
            continue
        if is_moe_param(tensor):
            name = groups.expert_group_name(expert_group_size(tensor))
            edp = mesh.ranks(f"expert_data_parallel:{name}")
            if len(edp) > 1:
                dist.broadcast(tensor.data, src=edp[0], group=mesh.group(f"expert_data_parallel:{name}"))
        elif len(mesh.ranks("sequence_data_parallel")) > 1:
            dist.broadcast(tensor.data, src=dense_src, group=group)
