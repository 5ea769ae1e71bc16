# SPDX-License-Identifier: Apache-2.0
"""Whole tensors of a tensor-parallel model: the unsharded state dict, and values for another tensor-parallel size.

* :func:`consolidated_state_dict` (``engine._consolidated_16bit_state_dict()``, ``save_16bit_model``,
  Accelerate's ``get_state_dict``): a collective; rank 0 gets the unsharded Hugging Face state dict
  (the model's parameter names, whole tensors in the model's dtype, persistent buffers; a tied
  parameter under each of its names), every other rank None. Each cut parameter is gathered over
  its tensor-parallel group and reassembled by its :class:`~deepspeed.module_inject.layers.ShardLayout`;
  under ZeRO-3 every parameter is first gathered over its data-parallel group.
* :func:`layout_of_model` / :func:`merge_shards` / :func:`local_piece`: the tensor-parallel
  layout a checkpoint records (name -> layout of each cut parameter), the whole value from every
  tensor-parallel rank's piece, and a rank's piece of a whole value; what saving, the universal
  format and loading at another tensor-parallel size use.
* :func:`merged_full_state`: every tensor-parallel rank's saved state of a checkpoint tag merged into
  whole tensors (``ds_to_universal`` writes the universal folder from it, and ``load_checkpoint`` loads a
  checkpoint saved at another tensor-parallel size through it); :func:`localize` cuts whole tensors into
  this rank's pieces.
"""

import torch

import deepspeed.comm as dist
from deepspeed.module_inject.layers import TP_LAYOUT_ATTR, ShardLayout
from deepspeed.runtime.checkpoint.consolidated import walk_whole_state

TP_LAYOUT_KEY = "tensor_parallel_layout"  # model-states entry: {name: ShardLayout.to_dict()}
TP_SIZE_KEY = "tensor_parallel_size"


def layout_of_model(module):
    """``{parameter name: ShardLayout}`` of every cut parameter of ``module``."""
    out = {}
    for name, param in module.named_parameters():
        layout = getattr(param, TP_LAYOUT_ATTR, None)
        if layout is not None:
            out[name] = layout
    return out


def encode_layout(module):
    return {name: layout.to_dict() for name, layout in layout_of_model(module).items()}


def decode_layout(entry):
    return {name: ShardLayout.from_dict(d) for name, d in (entry or {}).items()}


def merge_shards(layout, shards):
    """The whole tensor from every tensor-parallel rank's piece (``shards`` in rank order)."""
    return layout.assemble(list(shards))


def local_piece(layout, full, tp_size, tp_rank, name=None):
    """Rank ``tp_rank``'s piece of ``full`` at tensor-parallel size ``tp_size`` (the layout re-cut at that size)."""
    if layout.tp_size != tp_size:
        layout = ShardLayout.cut(layout.full_shape, layout.dim, tp_size, name, layout.sub_sizes)
    return layout.local(full, tp_rank)


def recut(layout, tp_size, name=None):
    """``layout`` at another tensor-parallel size (the same rules, so the cut is the one a fresh model gets)."""
    return layout if layout.tp_size == tp_size else ShardLayout.cut(layout.full_shape, layout.dim, tp_size, name,
                                                                    layout.sub_sizes)


def gather_whole(local, layout, group, device):
    """The whole tensor of which this rank holds ``local`` (a collective over ``group``)."""
    world = layout.tp_size
    if world == 1:
        return local
    moved = local.to(device).movedim(layout.dim, 0).contiguous()
    widest = max(layout.width(r) for r in range(world))
    if moved.shape[0] != widest:
        padded = moved.new_zeros((widest, *moved.shape[1:]))
        padded[:moved.shape[0]] = moved
        moved = padded
    out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved, group=group)
    out = out.view(world, *moved.shape)
    return layout.assemble([out[r][:layout.width(r)].movedim(0, layout.dim) for r in range(world)])


def _comm_device():
    if dist.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def consolidated_state_dict(engine, exclude_frozen_parameters=False):
    """See the module docstring (a collective over every rank)."""
    from deepspeed.utils import groups
    module = engine.module
    stage = engine._stage.checkpoint() if engine._stage is not None and engine.zero_optimization_stage() == 3 else None
    group = groups.get_tensor_model_parallel_group()
    device = _comm_device()
    keep = not dist.is_initialized() or dist.get_rank() == 0

    def whole_value(param):
        value = stage.full_16bit_value(param) if stage is not None and hasattr(param, "ds_id") else param.detach()
        layout = getattr(param, TP_LAYOUT_ATTR, None)
        if layout is not None and layout.tp_size > 1:
            value = gather_whole(value, layout, group, device)
        return value.detach().cpu().clone() if keep else value

    return walk_whole_state(module, whole_value, exclude_frozen_parameters)


def localize(module, values):
    """``values`` (a ``FullState``, or ``{name: tensor}``) with every whole tensor of a cut parameter replaced by this
    rank's piece; tensors already shaped like the piece, and everything else, are kept."""
    from deepspeed.runtime.checkpoint.reshard import FullState
    layouts = layout_of_model(module)
    if not layouts:
        return values
    rank = _tp_rank()

    def cut(name, tensor):
        layout = layouts.get(name)
        if layout is None or not torch.is_tensor(tensor) or tuple(tensor.shape) != layout.full_shape:
            return tensor
        return layout.local(tensor, rank)

    if isinstance(values, FullState):
        return FullState(fp32={
            n: cut(n, v)
            for n, v in values.fp32.items()
        },
                         state={
                             n: {
                                 k: cut(n, v)
                                 for k, v in st.items()
                             }
                             for n, st in values.state.items()
                         },
                         groups=values.groups,
                         group_names=values.group_names)
    return type(values)((n, cut(n, v)) for n, v in values.items())


def _tp_rank():
    from deepspeed.utils import groups
    return groups.get_tensor_model_parallel_rank()


def merge_values(layouts, per_rank):
    """``{name: whole tensor}`` from ``per_rank[t]`` (``{name: tensor}`` of tensor-parallel rank ``t``): cut names are
    reassembled by their layout, the others taken from rank 0 (they are the same on every rank)."""
    out = type(per_rank[0])()
    for name, value in per_rank[0].items():
        layout = layouts.get(name)
        if layout is not None and torch.is_tensor(value) and tuple(value.shape) != layout.full_shape:
            value = layout.assemble([rank_values[name] for rank_values in per_rank])
        out[name] = value
    return out


def merged_full_state(load_dir, tag):
    """``(model states, FullState, frozen, scaler)`` of the checkpoint ``<load_dir>/<tag>`` with every
    tensor-parallel rank's saved state merged into whole tensors; None when the tag was not saved tensor parallel.

    The model states are rank 0's, with ``module`` merged, whole shapes in ``param_shapes``, and the layout kept
    (``tensor_parallel_layout``) so the universal folder still says how the tensors were cut.
    """
    from deepspeed.runtime.checkpoint.reshard import FullState
    from deepspeed.runtime.checkpoint.saved import SavedCheckpoint
    first = SavedCheckpoint(load_dir, tag, 0, mp_rank=0, mp_size=None)
    tp = int(first.checkpoint.get(TP_SIZE_KEY) or 1)
    if tp == 1:
        return None
    layouts = decode_layout(first.checkpoint.get(TP_LAYOUT_KEY))
    saved = [first] + [SavedCheckpoint(load_dir, tag, 0, mp_rank=t, mp_size=None) for t in range(1, tp)]
    fulls, frozens, scaler = [], [], None
    for t, one in enumerate(saved):
        if one.saved_stage == 0:
            ckpt = one.checkpoint
            names = [n for group in ckpt.get("param_shapes") or [] for n in group]
            full, sc = one.stage0_full_state(names)
            frozen = {}
        else:
            full, frozen, sc = one.full_state(True)
        if one.saved_stage < 3:
            frozen_names = set(one.checkpoint.get("frozen_param_shapes") or {})
            frozen = {n: v for n, v in one.checkpoint["module"].items() if n in frozen_names and n not in full.fp32}
        fulls.append(full)
        frozens.append(frozen)
        scaler = sc if t == 0 else scaler
    merged = FullState(fp32=merge_values(layouts, [f.fp32 for f in fulls]),
                       groups=fulls[0].groups,
                       group_names=fulls[0].group_names)
    for name, state in fulls[0].state.items():
        layout = layouts.get(name)
        if layout is None:
            merged.state[name] = state
            continue
        merged.state[name] = {
            key:
            layout.assemble([f.state[name][key] for f in fulls])
            if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != layout.full_shape else value
            for key, value in state.items()
        }
    frozen = merge_values(layouts, frozens) if frozens[0] else {}
    model_states = dict(first.checkpoint)
    model_states["module"] = merge_values(layouts, [one.checkpoint["module"] for one in saved])
    if first.per_rank:  # ZeRO-3 files hold only buffers: the merged folder keeps the whole module instead
        dtype = next((v.dtype for v in model_states["module"].values() if torch.is_floating_point(v)), None)
        model_states["module"].update({n: v if dtype is None else v.to(dtype) for n, v in merged.fp32.items()})
        model_states["module"].update(frozen)
    model_states["param_shapes"] = [
        type(group)((n, torch.Size(layouts[n].full_shape) if n in layouts else shape) for n, shape in group.items())
        for group in first.checkpoint.get("param_shapes") or []
    ]
    model_states["frozen_param_shapes"] = type(first.checkpoint.get("frozen_param_shapes") or {})(
        (n, torch.Size(layouts[n].full_shape) if n in layouts else shape)
        for n, shape in (first.checkpoint.get("frozen_param_shapes") or {}).items())
    model_states[TP_SIZE_KEY] = 1
    model_states["mp_world_size"] = 1
    model_states["saved_" + TP_SIZE_KEY] = tp
    return model_states, merged, frozen, scaler, first


class MergedTensorParallel:
    """A checkpoint tag saved at another tensor-parallel size, read as whole tensors (the reader interface of
    ``UniversalCheckpoint``: ``full_state``, ``module_values``, ``optim_files``, ``stage``...); the loading engine
    cuts its own pieces (:func:`localize`)."""

    def __init__(self, load_dir, tag):
        self.load_dir, self.tag = load_dir, tag
        merged = merged_full_state(load_dir, tag)
        if merged is None:
            raise ValueError(f"{load_dir}/{tag}: not saved with tensor parallelism")
        self.checkpoint, self._full, self._frozen, self._scaler, first = merged
        # whole tensors in one model-states file: a ZeRO-3 source is read as a partitioned one (by name)
        self.stage = min(first.saved_stage, 2)
        self.has_optimizer = first.has_optimizer
        self.world_size = first.world_size
        self.per_rank = False

    def optim_files(self):
        return []

    def full_state(self, with_state=True, trainable_names=None):
        from deepspeed.runtime.checkpoint.reshard import FullState
        full = self._full
        if not with_state:
            full = FullState(fp32=full.fp32, groups=full.groups, group_names=full.group_names)
        return full, self._frozen, self._scaler

    def module_values(self):
        return dict(self.checkpoint["module"])
