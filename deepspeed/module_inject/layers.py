# SPDX-License-Identifier: Apache-2.0
"""Tensor-parallel linear layers for training (AutoTP), under upstream's names.

* :class:`LinearLayer` (column parallel): the weight's output rows (and the bias) are cut over
  the group; the input is replicated, the output sharded, or gathered whole with
  ``gather_output`` (an LM head).
* :class:`LinearAllreduce` (row parallel): the weight's input columns are cut; the input is
  sharded, the partial products are summed over the group, the bias (replicated) is added
  after the sum.
* :class:`SubParamLinearLayer` / :class:`SubParamLinearAllreduce`: a fused weight made of
  sub-parameters along the cut dimension (``[q; k; v]``, ``[gate; up]``), each cut on its own,
  so that rank ``r`` holds its piece of every sub-parameter (``fused_LinearLayer`` and
  ``GateUpPack_LinearLayer`` are the usual two).

A layer keeps the module's own ``Parameter`` objects and replaces their data by this rank's
piece, so an optimizer built before sharding still points at them. Each cut parameter carries
``tensor_model_parallel = True`` and a :class:`ShardLayout` (``ds_tp_layout``): the whole
shape, the cut dimension, the sub-parameter sizes and every rank's widths. From it the whole
tensor is reassembled (checkpoints, :class:`GatherReplacedLayerParams`) and any other
tensor-parallel size can cut its own piece.

The collectives are the four functions of ``deepspeed/runtime/tensor_parallel/mappings.py``.
"""

import copy
from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

import deepspeed.comm as dist
from deepspeed.module_inject.tp_shard import get_shard_size_list
from deepspeed.runtime.tensor_parallel import mappings
from deepspeed.runtime.tensor_parallel import replicated as _flow
from deepspeed.runtime.tensor_parallel.config import AUTOTP_MODE

DEEPSPEED_AUTOTP_MODE = AUTOTP_MODE.INFERENCE
DS_IS_REPLACED_MODULE = "ds_is_replaced_module"
DS_TENSOR_MODEL_PARALLEL = "tensor_model_parallel"
TP_LAYOUT_ATTR = "ds_tp_layout"


def get_auto_tp_mode():
    return DEEPSPEED_AUTOTP_MODE


def is_autotp_training_mode():
    return DEEPSPEED_AUTOTP_MODE == AUTOTP_MODE.TRAINING


def set_autotp_mode(training=False):
    """AutoTP layers are built for training (``training=True``) or inference."""
    global DEEPSPEED_AUTOTP_MODE
    DEEPSPEED_AUTOTP_MODE = AUTOTP_MODE.TRAINING if training else AUTOTP_MODE.INFERENCE


def add_bias(input, bias):
    return input if bias is None else input + bias


# ---------------------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class ShardLayout:
    """How one parameter is cut over the tensor-parallel group.

    ``full_shape``: the whole parameter's shape; ``dim``: the dimension that is cut;
    ``sub_sizes``: the sub-parameters along ``dim`` (one entry for a plain weight);
    ``widths[r][j]``: rank ``r``'s piece of sub-parameter ``j``. Rank ``r``'s tensor is the
    concatenation along ``dim`` of its pieces of every sub-parameter.
    """
    full_shape: Tuple[int, ...]
    dim: int
    sub_sizes: Tuple[int, ...]
    widths: Tuple[Tuple[int, ...], ...]

    @classmethod
    def cut(cls, full_shape, dim, tp_size, name=None, sub_sizes=None):
        full_shape = tuple(int(s) for s in full_shape)
        sub_sizes = tuple(int(s) for s in (sub_sizes or (full_shape[dim], )))
        if sum(sub_sizes) != full_shape[dim]:
            raise ValueError(
                f"AutoTP: the sub-parameter sizes {list(sub_sizes)} of {name or 'a parameter'} do not add "
                f"up to its dimension {dim} ({full_shape[dim]}, shape {list(full_shape)})")
        per_sub = [get_shard_size_list(size, tp_size, name) for size in sub_sizes]
        widths = tuple(tuple(per_sub[j][r] for j in range(len(sub_sizes))) for r in range(tp_size))
        return cls(full_shape, int(dim), sub_sizes, widths)

    @property
    def tp_size(self):
        return len(self.widths)

    def width(self, rank):
        return sum(self.widths[rank])

    def local_shape(self, rank):
        shape = list(self.full_shape)
        shape[self.dim] = self.width(rank)
        return tuple(shape)

    def _offsets(self, rank):
        """``(offset in the whole dimension, width)`` of each of rank ``rank``'s pieces."""
        out = []
        start = 0
        for j, size in enumerate(self.sub_sizes):
            before = sum(self.widths[r][j] for r in range(rank))
            out.append((start + before, self.widths[rank][j]))
            start += size
        return out

    def local(self, full, rank):
        """Rank ``rank``'s piece of the whole tensor ``full`` (a copy)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"AutoTP: expected a tensor of shape {list(self.full_shape)}, got {list(full.shape)}")
        pieces = [full.narrow(self.dim, start, width) for start, width in self._offsets(rank)]
        return torch.cat(pieces, dim=self.dim) if len(pieces) > 1 else pieces[0].clone()

    def assemble(self, shards):
        """The whole tensor from every rank's piece (``shards[r]``, in rank order)."""
        if len(shards) != self.tp_size:
            raise ValueError(f"AutoTP: {len(shards)} pieces for a tensor cut over {self.tp_size} ranks")
        out = shards[0].new_empty(self.full_shape)
        for rank, shard in enumerate(shards):
            if tuple(shard.shape) != self.local_shape(rank):
                raise ValueError(f"AutoTP: rank {rank}'s piece has shape {list(shard.shape)}, the layout expects "
                                 f"{list(self.local_shape(rank))}")
            taken = 0
            for start, width in self._offsets(rank):
                out.narrow(self.dim, start, width).copy_(shard.narrow(self.dim, taken, width))
                taken += width
        return out

    def to_dict(self):
        return dict(full_shape=list(self.full_shape),
                    dim=self.dim,
                    sub_sizes=list(self.sub_sizes),
                    widths=[list(w) for w in self.widths])

    @classmethod
    def from_dict(cls, d):
        return cls(tuple(d["full_shape"]), int(d["dim"]), tuple(d["sub_sizes"]), tuple(tuple(w) for w in d["widths"]))


def _all_gather_whole(param, layout, group):
    """The whole tensor of ``param`` (this rank holds its piece) from every rank of ``group``."""
    world = layout.tp_size
    local = param.data.contiguous()
    widest = max(layout.width(r) for r in range(world))
    moved = local.movedim(layout.dim, 0).contiguous()
    if moved.shape[0] != widest:
        padded = moved.new_zeros((widest, *moved.shape[1:]))
        padded[:moved.shape[0]] = moved
        moved = padded
    out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved, group=group)
    out = out.view(world, *moved.shape)
    shards = [out[r][:layout.width(r)].movedim(0, layout.dim) for r in range(world)]
    return layout.assemble(shards)


def _sub_sizes_from_shape(shape, partition_dim, full_shape, name):
    """The sub-parameter sizes along ``partition_dim`` a partition_config ``shape`` describes (None: no sub-params).

    ``shape`` has the weight's rank: at ``partition_dim`` an int ``n`` (``n`` equal sub-parameters), a tuple of sizes
    (unequal ones, GQA's q, k, v) or -1 (one); every other entry -1 or the weight's size there.
    """
    if shape is None:
        return None
    shape = tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in shape)
    if len(shape) != len(full_shape):
        raise NotImplementedError(f"AutoTP: {name}: a partition shape {list(shape)} of another rank than the weight "
                                  f"({list(full_shape)}) is not supported; give one entry per weight dimension")
    for d, entry in enumerate(shape):
        if d != partition_dim and entry not in (-1, full_shape[d]):
            raise ValueError(f"AutoTP: {name}: partition shape {list(shape)} does not match the weight's shape "
                             f"{list(full_shape)} at dimension {d}")
    entry = shape[partition_dim]
    total = full_shape[partition_dim]
    if isinstance(entry, tuple):
        return tuple(int(s) for s in entry)
    if entry == -1:
        return None
    if total % int(entry) != 0:
        raise ValueError(f"AutoTP: {name}: dimension {partition_dim} ({total}) is not {entry} equal sub-parameters")
    return tuple([total // int(entry)] * int(entry))


# ----------------------------------------------------------------------------------------- layers
class TensorParallel_Layer(nn.Module):
    """Base of the tensor-parallel layers (module docstring)."""

    keep_module_on_host: bool = False
    tp_overlap_comm: bool = False

    def __init__(self, mp_group=None, **kwargs):
        super().__init__()
        self.support_training = True
        self.mp_group = mp_group
        if mp_group is not None and dist.is_initialized():
            self.tp_world_size = dist.get_world_size(group=mp_group)
            self.tp_index = dist.get_rank(group=mp_group)
        else:
            self.tp_world_size, self.tp_index = 1, 0
        self.world_size = self.tp_world_size
        self.rank = self.tp_index
        self.name = kwargs.get("name", getattr(self, "name", None))

    @classmethod
    def set_keep_module_on_host(cls, value):
        cls.keep_module_on_host = bool(value)

    def is_training_mode(self):
        return is_autotp_training_mode()

    # the layouts --------------------------------------------------------------------
    def _cut(self, param, dim, sub_sizes=None, skip_partition=False):
        """Give ``param`` its layout and (unless ``skip_partition``: it already holds this rank's piece) cut it."""
        if param is None:
            return
        full_shape = tuple(getattr(param, "ds_shape", param.shape))
        layout = ShardLayout.cut(full_shape, dim, self.tp_world_size, self.name, sub_sizes)
        if self.tp_world_size > 1 and layout.width(self.tp_index) == 0:
            raise ValueError(f"AutoTP: {self.name or type(self).__name__}: tensor-parallel rank {self.tp_index} would "
                             f"hold no part of dimension {dim} of a {list(full_shape)} weight (widths "
                             f"{[layout.width(r) for r in range(layout.tp_size)]}); use a tensor-parallel size of "
                             f"at most the number of key/value heads")
        setattr(param, TP_LAYOUT_ATTR, layout)
        setattr(param, DS_TENSOR_MODEL_PARALLEL, True)
        setattr(param, DS_IS_REPLACED_MODULE, True)
        param.gather_params = self.gather_params
        param._tp_partition = self._tp_partition
        if not skip_partition and self.tp_world_size > 1:
            with torch.no_grad():
                param.data = layout.local(param.data, self.tp_index)

    def _replicated(self, param):
        if param is not None:
            setattr(param, DS_IS_REPLACED_MODULE, True)

    @property
    def _partition_sizes(self):
        return [self.weight.ds_tp_layout.width(r) for r in range(self.tp_world_size)]

    @torch.no_grad()
    def gather_params(self, params_list):
        """Make every cut parameter of ``params_list`` whole in place (a collective over the group)."""
        for param in params_list:
            layout = getattr(param, TP_LAYOUT_ATTR, None) if param is not None else None
            if layout is None or self.tp_world_size == 1 or tuple(param.shape) == layout.full_shape:
                continue
            param.data = _all_gather_whole(param, layout, self.mp_group)

    @torch.no_grad()
    def _tp_partition(self, params_list):
        """Cut every whole parameter of ``params_list`` back to this rank's piece."""
        for param in params_list:
            layout = getattr(param, TP_LAYOUT_ATTR, None) if param is not None else None
            if layout is None or self.tp_world_size == 1 or tuple(param.shape) != layout.full_shape:
                continue
            param.data = layout.local(param.data, self.tp_index)

    def __deepcopy__(self, memo):
        # a process group cannot be copied: the copy shares it
        memo[id(self.mp_group)] = self.mp_group
        cls = type(self)
        copied = cls.__new__(cls)
        memo[id(self)] = copied
        for key, value in self.__dict__.items():
            setattr(copied, key, copy.deepcopy(value, memo))
        return copied

    def extra_repr(self):
        weight = getattr(self, "weight", None)
        shape = list(weight.shape) if weight is not None else None
        return f"tp_rank={self.tp_index}, tp_size={self.tp_world_size}, local_weight={shape}"


class LinearLayer(TensorParallel_Layer):
    """Column parallel (module docstring). ``module``: an ``nn.Linear`` (its parameters are kept, cut)."""

    def __init__(self, module, mp_group=None, skip_partition=False, gather_output=False, **kwargs):
        super().__init__(mp_group, **kwargs)
        self.weight = module.weight
        self.bias = module.bias
        self.gather_output = bool(gather_output)
        self.in_features = getattr(module, "in_features", self.weight.shape[1])
        sub_sizes = kwargs.get("sub_sizes")
        self._cut(self.weight, 0, sub_sizes, skip_partition)
        self._cut(self.bias, 0, sub_sizes, skip_partition)
        self.out_features = self.weight.ds_tp_layout.full_shape[0]

    def forward(self, input):
        group = self.mp_group
        if self.tp_overlap_comm:
            output = mappings.linear_with_async_allreduce(input, self.weight, self.bias, group)
        else:
            output = F.linear(mappings.copy_to_region(input, group), self.weight, self.bias)
        if self.gather_output:
            output = mappings.gather_from_region(output, group, self._partition_sizes)
        elif self.tp_world_size > 1:
            _flow.mark(output, sharded=True)
        return output

    @classmethod
    def from_weights(cls, weight_shape=None, dtype=torch.half, weight=None, bias=None, gather_output=False):
        """A layer holding ``weight`` / ``bias`` as they are (already this rank's piece)."""
        if weight is None:
            weight = torch.empty(weight_shape, dtype=dtype)
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        linear.weight.data = weight
        if bias is not None:
            linear.bias.data = bias
        return cls(linear, skip_partition=True, gather_output=gather_output)


class LinearAllreduce(TensorParallel_Layer):
    """Row parallel (module docstring): the bias stays replicated and is added after the sum."""

    def __init__(self, module, mp_group=None, skip_partition=False, **kwargs):
        super().__init__(mp_group, **kwargs)
        self.weight = module.weight
        self.bias = module.bias
        self.in_features = self.weight.ds_shape[1] if hasattr(self.weight, "ds_shape") else self.weight.shape[1]
        self.out_features = self.weight.shape[0]
        self._cut(self.weight, 1, kwargs.get("sub_sizes"), skip_partition)
        self._replicated(self.bias)

    def forward(self, input):
        output = mappings.reduce_from_region(F.linear(input, self.weight), self.mp_group)
        if self.tp_world_size > 1:
            _flow.mark(output, sharded=False)
        return add_bias(output, self.bias)


class SubParamLinearLayer(LinearLayer):
    """Column parallel over a fused weight (``shape``/``partition_dim``, as partition_config gives them)."""

    def __init__(self, module, mp_group=None, shape=None, partition_dim=0, **kwargs):
        if partition_dim != 0:
            raise NotImplementedError(f"AutoTP: a column-parallel sub-parameter layer cuts dimension 0 of the weight, "
                                      f"got partition_dim={partition_dim}")
        full = tuple(getattr(module.weight, "ds_shape", module.weight.shape))
        kwargs["sub_sizes"] = _sub_sizes_from_shape(shape, 0, full, kwargs.get("name"))
        self.shape, self.partition_dim = shape, partition_dim
        super().__init__(module, mp_group, **kwargs)


class SubParamLinearAllreduce(LinearAllreduce):
    """Row parallel over a fused input dimension (``shape``/``partition_dim``)."""

    def __init__(self, module, mp_group=None, shape=None, partition_dim=1, **kwargs):
        if partition_dim != 1:
            raise NotImplementedError(
                f"AutoTP: a row-parallel sub-parameter layer cuts dimension 1 of the weight, got "
                f"partition_dim={partition_dim}")
        full = tuple(getattr(module.weight, "ds_shape", module.weight.shape))
        kwargs["sub_sizes"] = _sub_sizes_from_shape(shape, 1, full, kwargs.get("name"))
        self.shape, self.partition_dim = shape, partition_dim
        super().__init__(module, mp_group, **kwargs)


class fused_LinearLayer(SubParamLinearLayer):
    """A fused ``[q; k; v]`` projection of equal parts (give ``shape=((q, k, v), -1)`` for GQA's unequal ones)."""

    def __init__(self, module, mp_group=None, skip_partition=False, **kwargs):
        kwargs.setdefault("shape", (3, -1))
        super().__init__(module, mp_group, skip_partition=skip_partition, **kwargs)


class GateUpPack_LinearLayer(SubParamLinearLayer):
    """A fused ``[gate; up]`` projection."""

    def __init__(self, module, mp_group=None, **kwargs):
        kwargs.setdefault("shape", (2, -1))
        super().__init__(module, mp_group, **kwargs)


class GatherReplacedLayerParams:
    """Inside the context the given parameters of tensor-parallel layers are whole (a collective on entry and
    nothing on exit but the cut); parameters of other modules are left alone."""

    def __init__(self, params, module, enabled=True):
        self.module = module
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params if p is not None]
        self.enabled = enabled and any(getattr(p, DS_IS_REPLACED_MODULE, False) for p in self.params)

    def __enter__(self):
        if self.enabled:
            for param in self.params:
                if getattr(param, TP_LAYOUT_ATTR, None) is not None:
                    param.gather_params([param])

    def __exit__(self, exc_type, exc_value, traceback):
        if self.enabled:
            for param in self.params:
                if getattr(param, TP_LAYOUT_ATTR, None) is not None:
                    param._tp_partition([param])
        return False


def configure_tensor_parallel_runtime(config):
    """The layer-wide settings of the ``tensor_parallel`` section (``tp_overlap_comm``, ``keep_module_on_host``)."""
    TensorParallel_Layer.tp_overlap_comm = bool(getattr(config, "tp_overlap_comm", False))
    TensorParallel_Layer.keep_module_on_host = bool(getattr(config, "keep_module_on_host", False))
