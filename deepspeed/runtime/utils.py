# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``deepspeed.runtime.utils``: partitioning, norms, overflow checks, device moves, small helpers.

Each function is written from its contract:

* ``partition_uniform(n, k)`` -> ``k + 1`` boundaries of ``k`` contiguous parts of ``n`` items whose sizes differ
  by at most one, the larger parts first; with ``n <= k`` part ``p`` holds item ``p`` (the rest are empty).
* ``partition_balanced(weights, k)`` -> ``k + 1`` boundaries of contiguous parts chosen by upstream's linear
  partition recurrence: for each prefix and part count, the cut that keeps the spread (heaviest part minus
  lightest part) of the prefix's parts smallest, the latest such cut on a tie; ``n <= k`` falls back to
  ``partition_uniform``. The recurrence is upstream's definition of "balanced", so pipeline layer assignments
  computed here equal upstream's.
* Norms are p-norms over every tensor taken as one vector, ``inf`` for the max-norm, summed (max-reduced) over
  the model-parallel group of ``mpu`` when one is given.

Not here, on purpose: ``all_gather_dp_groups`` / ``all_gather_into_tensor_dp_groups`` (the all-gather of
upstream's stage 1-2 flat partitions; this runtime's stages all-gather inside their own geometry) and
``get_norm_with_moe_layers`` / ``get_norm_with_moe_layers_fast`` (the MoE norm combination lives with the MoE
groups in ``deepspeed.moe``).
"""

import gc
import os
from math import inf, isfinite, sqrt
from typing import Dict, List, Sequence, Union

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.constants import PIPE_REPLICATED

__all__ = [
    "partition_uniform", "partition_balanced", "prefix_sum_inc", "count_used_parameters_in_backward",
    "check_internal_apis_for_count_used_parameters", "move_to_device", "copy_to_device", "noop_context",
    "noop_decorator", "see_memory_usage", "set_random_seed", "get_global_norm", "clip_grad_norm_",
    "get_global_norm_of_tensors", "clip_tensors_by_global_norm", "has_inf_or_nan", "is_invalid_grad_norm",
    "combine_grad_norm_groups", "CheckOverflow", "DummyOptim", "PartitionedTensor", "TLinear"
]

mem_alloced = 0
mem_cached = 0

#########################################
# Partitioning
#########################################


def prefix_sum_inc(weights):
    """Inclusive prefix sums: ``[3, 4, 5]`` -> ``[3, 7, 12]``."""
    sums, running = [], 0
    for i, w in enumerate(weights):
        running = w if i == 0 else running + w
        sums.append(running)
    return sums


def partition_uniform(num_items, num_parts):
    """Boundaries of ``num_parts`` near-equal contiguous parts of ``num_items`` (see the module docstring)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    base, extra = divmod(num_items, num_parts)
    return [p * base + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights, num_parts):
    """Boundaries of ``num_parts`` contiguous parts of ``weights`` by the spread recurrence (module docstring)."""
    weights = list(weights)
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    # best[j][i] = (spread, heaviest, lightest) of the chosen split of the first i items into j parts;
    # cut[j][i] = where its last part starts.
    best = [[None] * (n + 1) for _ in range(m + 1)]
    cut = [[0] * (n + 1) for _ in range(m + 1)]
    best[0][0] = (0.0, 0.0, inf)
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            chosen = None
            for k in range(i):
                previous = best[j - 1][k]
                if previous is None:  # k items cannot be cut into j - 1 parts
                    continue
                part = prefix[i] - prefix[k]
                heaviest = max(previous[1], part) if j > 1 else part
                lightest = min(previous[2], part)
                spread = heaviest - lightest
                if chosen is None or spread <= chosen[0]:  # the latest cut wins a tie
                    chosen = (spread, heaviest, lightest)
                    cut[j][i] = k
            best[j][i] = chosen
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(cut[j][bounds[-1]])
    return bounds[::-1]


#########################################
# Backward introspection and output hooks
#########################################


def check_internal_apis_for_count_used_parameters() -> bool:
    """Whether this torch has the autograd internals :func:`count_used_parameters_in_backward` needs."""
    return (hasattr(torch.autograd.graph, "_get_grad_fn_or_grad_acc") and hasattr(torch._C, "_current_graph_task_id")
            and hasattr(torch._C, "_will_engine_execute_node"))


def count_used_parameters_in_backward(parameters: Sequence[torch.nn.Parameter]) -> int:
    """How many distinct gradient nodes of ``parameters`` the running backward will execute.

    Call it from inside a backward (a hook); outside one it raises ``RuntimeError``. Parameters that do not
    require grad, and parameters sharing one accumulation node, are counted once or not at all accordingly.
    """
    if not check_internal_apis_for_count_used_parameters():
        raise RuntimeError("count_used_parameters_in_backward needs torch.autograd.graph._get_grad_fn_or_grad_acc "
                           "and torch._C._will_engine_execute_node, which this torch build lacks")
    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward must be called during backward execution")
    from torch.autograd.graph import _get_grad_fn_or_grad_acc
    nodes = {}
    for param in parameters:
        if not isinstance(param, torch.Tensor) or not param.requires_grad:
            continue
        with torch.enable_grad():  # hooks run with grad mode off; the accumulation node needs it on
            node = _get_grad_fn_or_grad_acc(param)
        if node is not None:
            nodes[id(node)] = node
    return sum(int(torch._C._will_engine_execute_node(node)) for node in nodes.values())


def maybe_loss_for_backward(value) -> bool:
    """Whether ``value`` looks like a loss: a one-element tensor with a ``grad_fn``."""
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.grad_fn is not None


class OutputBackwardHookManager:
    """Gradient hooks on a forward's outputs: ``preprocess_once_fn()`` runs once per backward, before the first
    output's gradient flows on; ``preprocess_per_tensor_fn(grad)`` (if given) may replace each output's gradient.

    The manager is kept alive by the first hooked output, so it lives as long as the outputs do.
    """

    def __init__(self, preprocess_once_fn, preprocess_per_tensor_fn=None):
        self.preprocess_once_fn = preprocess_once_fn
        self.preprocess_per_tensor_fn = preprocess_per_tensor_fn
        self.preprocess_done = False
        self.hook_handles = []

    def _hook(self, grad):
        if not self.preprocess_done:
            self.preprocess_done = True
            self.preprocess_once_fn()
        if self.preprocess_per_tensor_fn is not None:
            return self.preprocess_per_tensor_fn(grad)
        return grad

    def _tensors(self, outputs):
        if isinstance(outputs, torch.Tensor):
            if outputs.grad_fn is not None:
                yield outputs
        elif isinstance(outputs, (tuple, list)):
            for item in outputs:
                yield from self._tensors(item)
        elif isinstance(outputs, dict):
            for item in outputs.values():
                yield from self._tensors(item)

    def register_hooks_on_outputs(self, outputs):
        """Hook every output tensor that has a ``grad_fn`` (nested tuples, lists and dicts are searched)."""
        self.reset()
        self.remove_hooks()
        tensors = list(self._tensors(outputs))
        self.hook_handles = [t.register_hook(self._hook) for t in tensors]
        if tensors:
            if not hasattr(tensors[0], "_backward_hook_managers"):
                tensors[0]._backward_hook_managers = []
            tensors[0]._backward_hook_managers.append(self)

    def remove_hooks(self):
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []

    def reset(self):
        """Arm ``preprocess_once_fn`` again (for the next backward over the same outputs)."""
        self.preprocess_done = False


def register_output_backward_hooks(outputs, preprocess_once_fn, preprocess_per_tensor_fn=None):
    """Build an :class:`OutputBackwardHookManager` and hook ``outputs``; returns the manager."""
    manager = OutputBackwardHookManager(preprocess_once_fn, preprocess_per_tensor_fn)
    manager.register_hooks_on_outputs(outputs)
    return manager


#########################################
# Moving and comparing nested structures
#########################################


def copy_to_device(item, device, criterion_func):
    """A copy of ``item`` with each leaf that passes ``criterion_func`` moved to ``device`` (lists, tuples and
    dicts are rebuilt; other leaves are returned as they are)."""
    if criterion_func(item):
        return item.to(device)
    if isinstance(item, list):
        return [copy_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(copy_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: copy_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def move_to_device(item, device, criterion_func=None):
    """Move tensors in ``item`` (nested lists, tuples, dicts) to ``device``.

    Without ``criterion_func`` every leaf is ``.to(device)``-ed. With it, a leaf that passes is moved in place
    (its ``.data`` now lives on ``device``, so other references see the move) and returned; the others are
    ``.to(device)``-ed as well, as upstream does.
    """
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)


def get_tensor_bytes(item):
    """Bytes of every tensor in ``item`` (nested lists, tuples, dicts); other leaves count 0."""
    if torch.is_tensor(item):
        return item.numel() * item.element_size()
    if isinstance(item, (list, tuple)):
        return sum(get_tensor_bytes(v) for v in item)
    if isinstance(item, dict):
        return sum(get_tensor_bytes(v) for v in item.values())
    return 0


def is_transformers_cache(obj):
    """Whether ``obj`` is a Transformers ``Cache`` (compared by type only in :func:`compare_tensors_in_structures`)."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:
        return False
    return isinstance(obj, Cache)


def _equal_leaves(a, b):
    if is_transformers_cache(a) and is_transformers_cache(b):
        return type(a) is type(b)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    return a == b


def compare_tensors_in_structures(inputs1: Union[List, Dict], inputs2: Union[List, Dict]) -> bool:
    """Whether two lists (or two dicts) hold equal values, tensors compared element-wise; other types: False."""
    if type(inputs1) is not type(inputs2):
        return False
    if isinstance(inputs1, list):
        return len(inputs1) == len(inputs2) and all(_equal_leaves(a, b) for a, b in zip(inputs1, inputs2))
    if isinstance(inputs1, dict):
        return inputs1.keys() == inputs2.keys() and all(_equal_leaves(inputs1[k], inputs2[k]) for k in inputs1)
    return False


#########################################
# Norms, clipping, overflow
#########################################


def is_model_parallel_parameter(p) -> bool:
    """Whether ``p`` is split over the model-parallel group (Megatron's ``model_parallel`` /
    ``tensor_model_parallel`` flags)."""
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def has_inf_or_nan(x):
    """Whether ``x`` holds a NaN or an infinity, as a bool scalar tensor on ``x``'s device (no host sync).

    Sparse tensors are checked on their stored values; an empty tensor has none.
    """
    if x.is_sparse:
        x = x._values()
    if x.numel() == 0:
        return torch.tensor(False, device=x.device)
    # max propagates NaN and shows +inf, min shows -inf: two scalars answer it without an elementwise mask.
    return ~(torch.isfinite(x.amax()) & torch.isfinite(x.amin()))


def is_invalid_grad_norm(norm):
    """Whether a norm is non-finite or negative (upstream marks failed norms with -1)."""
    if torch.is_tensor(norm):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    return not isfinite(float(norm)) or norm < 0


def mask_nan_or_inf_with_val_inplace(input, device=None, val=-1.):
    """Replace NaN and infinite entries of ``input`` with ``val``, in place."""
    input.masked_fill_(~torch.isfinite(input), val)


def get_global_norm(norm_list):
    """The 2-norm of per-group 2-norms: ``sqrt(sum(n ** 2))``; ``inf`` if one of them is invalid."""
    if any(is_invalid_grad_norm(norm) for norm in norm_list):
        return float("inf")
    return sqrt(sum(float(norm)**2.0 for norm in norm_list))


def combine_grad_norm_groups(norm_groups, norm_type=2):
    """Combine per-group norms into one (``ord=norm_type``) as a tensor; ``inf`` when any group is invalid
    (a -1 marker must not pass as a healthy group)."""
    norm_groups = list(norm_groups)
    device = next((n.device for n in norm_groups if torch.is_tensor(n)), None)
    stacked = torch.stack([
        n.float() if torch.is_tensor(n) else torch.tensor(float(n), dtype=torch.float, device=device)
        for n in norm_groups
    ])
    combined = torch.linalg.vector_norm(stacked, ord=norm_type)
    invalid = (~torch.isfinite(stacked) | (stacked < 0)).any()
    return torch.where(invalid, torch.full_like(combined, inf), combined)


def _reduce_over_model_parallel(value, mpu, op):
    if mpu is not None:
        dist.all_reduce(value, op=op, group=mpu.get_model_parallel_group())
    return value


def _tensor_mp_rank(mpu):
    if mpu is None:
        return 0
    if hasattr(mpu, "get_tensor_model_parallel_rank"):
        return mpu.get_tensor_model_parallel_rank()
    return mpu.get_model_parallel_rank()


def _counted_once(p, mpu):
    """Whether ``p`` is counted on this rank: pipeline replicas and (beyond tp rank 0) replicated tensors are not."""
    if getattr(p, PIPE_REPLICATED, False):
        return False
    return _tensor_mp_rank(mpu) == 0 or is_model_parallel_parameter(p)


def _p_norm(tensors, norm_type, mpu):
    """The ``norm_type``-norm of ``tensors`` as one vector (fp32 scalar on the device of the first)."""
    device = tensors[0].device if tensors else torch.device(get_accelerator().current_device_name())
    if norm_type == inf:
        total = torch.stack([t.detach().abs().max().float() for t in tensors]).max() if tensors else \
            torch.zeros((), device=device)
        return _reduce_over_model_parallel(total, mpu, dist.ReduceOp.MAX)
    if tensors:
        total = torch.stack([t.detach().float().norm(norm_type).to(device) for t in tensors]).pow(norm_type).sum()
    else:
        total = torch.zeros((), device=device)
    return _reduce_over_model_parallel(total, mpu, dist.ReduceOp.SUM).pow(1.0 / norm_type)


def get_global_norm_of_tensors(input_tensors, norm_type=2, mpu=None, moe_ep_group=None):
    """The ``norm_type``-norm of ``input_tensors`` as one vector, a detached fp32 scalar tensor (summed over
    ``mpu``'s model-parallel group and over ``moe_ep_group`` when given)."""
    input_tensors = list(input_tensors)
    if not all(torch.is_tensor(t) for t in input_tensors):
        raise TypeError("get_global_norm_of_tensors expects an iterable of tensors")
    norm_type = float(norm_type)
    if moe_ep_group is None:
        return _p_norm(input_tensors, norm_type, mpu)
    power = _p_norm(input_tensors, norm_type, mpu)
    if norm_type == inf:
        dist.all_reduce(power, op=dist.ReduceOp.MAX, group=moe_ep_group)
        return power
    power = power.pow(norm_type)
    dist.all_reduce(power, op=dist.ReduceOp.SUM, group=moe_ep_group)
    return power.pow(1.0 / norm_type)


def clip_tensors_by_global_norm(input_tensors, max_norm=1.0, global_norm=None, mpu=None, eps=1e-6):
    """Scale ``input_tensors`` in place by ``max_norm / (norm + eps)`` when that is below 1; returns the norm."""
    if global_norm is None:
        global_norm = get_global_norm_of_tensors(input_tensors, mpu=mpu)
    coef = max_norm / (global_norm + eps)
    if coef < 1:
        for tensor in input_tensors:
            tensor.detach().mul_(coef)
    return global_norm


def clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None):
    """Clip the gradients of ``parameters`` in place to a total ``norm_type``-norm of ``max_norm``.

    The norm is taken over the model-parallel group of ``mpu`` and then averaged over the data-parallel ranks
    (equal on every rank, and the local norm where gradients are already reduced). Returns that norm.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    grads = [p.grad for p in parameters if norm_type == inf or mpu is None or _counted_once(p, mpu)]
    total = _p_norm(grads, norm_type, mpu)
    if dist.is_initialized() and dist.get_world_size() > 1:
        total = total / float(dist.get_world_size())
        dist.all_reduce(total)
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for p in parameters:
            p.grad.detach().mul_(coef)
    return total


def get_flattened_grad_norm(parameters, norm_type=2, mpu=None, grad_norm_mask=None):
    """The ``norm_type``-norm of the gradients of ``parameters`` as a float, -1 if it is not finite.

    ``grad_norm_mask[i]`` (a ``[k, 2]`` tensor of ``[start, end)`` ranges) leaves those elements of parameter
    ``i``'s gradient out of the norm.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    grads = []
    for i, p in enumerate(parameters):
        grad = p.grad.detach()
        if grad_norm_mask is not None and len(grad_norm_mask[i]) > 0:
            keep = torch.ones(grad.shape[0], dtype=torch.bool, device=grad.device)
            for start, end in grad_norm_mask[i].tolist():
                keep[start:end] = False
            grad = grad[keep]
        grads.append(grad)
    total = float(_p_norm(grads, float(norm_type), mpu))
    return -1 if not isfinite(total) else total


def get_grad_norm(parameters, norm_type=2, mpu=None):
    """:func:`get_flattened_grad_norm` without a mask (upstream's older name)."""
    return get_flattened_grad_norm(parameters, norm_type=norm_type, mpu=mpu)


def get_weight_norm(parameters, norm_type=2, mpu=None):
    """The ``norm_type``-norm of the values of ``parameters`` as a float, -1 if it is not finite (pipeline
    replicas and tensor-parallel replicas are counted once)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    norm_type = float(norm_type)
    tensors = [p.data for p in parameters if norm_type == inf or _counted_once(p, mpu)]
    total = float(_p_norm(tensors, norm_type, mpu))
    return -1 if not isfinite(total) else total


def get_grad_zeros(parameters, mpu=None):
    """How many gradient elements of ``parameters`` are exactly zero (summed over ``mpu``'s model-parallel group)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    zeros = 0
    for p in parameters:
        if p.grad is not None and _counted_once(p, mpu):
            zeros += p.grad.numel() - int(torch.count_nonzero(p.grad))
    total = torch.tensor([float(zeros)], device=get_accelerator().current_device_name())
    return float(_reduce_over_model_parallel(total, mpu, dist.ReduceOp.SUM)[0])


class CheckOverflow:
    """Whether any gradient of a set of parameters holds a NaN or an infinity, agreed across ranks.

    ``param_groups`` is a list of parameter lists. The verdict is the engine's own skip decision
    (:func:`deepspeed.runtime.precision.overflow.agreed_overflow`): true on every rank when a gradient (or, in
    :meth:`check_using_norm`, a norm) is not finite on any rank its gradients span: the data-parallel group, which
    holds the expert groups of MoE parameters, and the model-parallel group, of ``mpu`` when one is given, else of
    the mesh. ``zero_reduce_scatter``, ``deepspeed`` and ``reduce_overflow`` are upstream's switches for which of
    those groups to reduce over; they are accepted, and the verdict is always agreed over all of them (a rank whose
    own gradients are finite must not step while a peer skips). :meth:`has_overflow_serial` is this rank's
    finding alone.
    """

    def __init__(self, param_groups=None, mpu=None, zero_reduce_scatter=False, deepspeed=None):
        from deepspeed.moe.utils import is_moe_param
        self.mpu = mpu
        self.zero_reduce_scatter = zero_reduce_scatter
        self.deepspeed = deepspeed
        self.params = [p for group in param_groups for p in group] if param_groups else None
        self.has_moe_params = any(is_moe_param(p) for p in self.params or ())

    def _agree(self, local):
        from deepspeed.runtime.precision.overflow import agreed_overflow, overflow_groups
        return agreed_overflow(local, overflow_groups(self.mpu))

    def check_using_norm(self, norm_group, reduce_overflow=True):
        """Overflow from already computed norms (a norm that is non-finite or negative, upstream's -1, counts)."""
        return self._agree(any(is_invalid_grad_norm(n) for n in norm_group))

    def check(self, param_groups=None):
        params = self.params if param_groups is None else [p for group in param_groups for p in group]
        return self.has_overflow(params or [])

    def has_overflow_serial(self, params):
        """This rank's finding, without communication."""
        return any(p.grad is not None and bool(has_inf_or_nan(p.grad.data)) for p in params)

    def has_overflow(self, params, has_moe_params=None):
        return self._agree(self.has_overflow_serial(params))


#########################################
# Parameters and optimizers
#########################################


def is_optimized_parameter(param):
    """Whether an optimizer owns ``param``: it is trainable and has at least one element (ZeRO-3 ``ds_numel``)."""
    numel = param.ds_numel if hasattr(param, "ds_numel") else param.numel()
    return bool(param.requires_grad) and numel > 0


def get_inactive_params(param_list):
    """The ZeRO-3 parameters of ``param_list`` that are partitioned now (``ds_status`` NOT_AVAILABLE)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return [p for p in param_list if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def filter_empty_parameters(params):
    """``params`` (a list of tensors, or of param-group dicts) without zero-element parameters; a group left with
    no parameter is dropped."""
    if not isinstance(params, (list, tuple)) or len(params) == 0:
        return params
    if isinstance(params[0], dict):
        groups = []
        for group in params:
            kept = [p for p in group.get("params", []) if p.numel() > 0]
            if kept:
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": kept})
        return groups
    return [p for p in params if p.numel() > 0]


class DummyOptim:
    """A stand-in optimizer that only presents ``params`` as one param group (no ``step``)."""

    def __init__(self, params):
        self.param_groups = [{"params": params}]


def align_dense_tensors(tensor_list, alignment):
    """``tensor_list`` plus a zero tensor that pads its total element count to a multiple of ``alignment``."""
    remainder = sum(t.numel() for t in tensor_list) % alignment
    if not remainder:
        return tensor_list
    pad = torch.zeros(alignment - remainder, device=tensor_list[0].device, dtype=tensor_list[0].dtype)
    return tensor_list + [pad]


class TLinear(torch.nn.Linear):
    """A ``Linear`` built from another layer whose weight is stored transposed (``[in, out]``, as Megatron's
    ``Conv1D``): the weight is transposed into ``Linear``'s ``[out, in]`` layout, the bias is shared."""

    def __init__(self, orig_layer, name=""):
        self.name = name
        super().__init__(orig_layer.weight.shape[1],
                         orig_layer.weight.shape[0],
                         bias=(orig_layer.bias is not None),
                         device=orig_layer.weight.device,
                         dtype=orig_layer.weight.dtype)
        self.weight.data = orig_layer.weight.data.t()
        self.bias = orig_layer.bias

    def forward(self, input):
        return torch.nn.functional.linear(input, self.weight, self.bias)


#########################################
# Partitioned tensors
#########################################


class PartitionedTensor:
    """One rank's contiguous part of a tensor flattened and split over a process group (``partition_uniform``
    cuts), which :meth:`full` all-gathers back. :meth:`to_meta` / :meth:`from_meta` carry the layout in one
    int64 tensor, ``[ndim, *shape, num_parts, *boundaries]``, so another stage can rebuild the object from
    its own local part."""

    def __init__(self, tensor, group, partition_meta=None):
        self.group = group
        self.num_parts = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(tensor.numel(), self.num_parts)
        flat = tensor.detach().contiguous().view(-1)
        self.local_data = flat[self.partition[self.rank]:self.partition[self.rank + 1]].clone()
        self.even_split = tensor.numel() % self.num_parts == 0

    @classmethod
    def from_meta(cls, meta, local_part, group, device="cpu"):
        meta = [int(v) for v in meta.tolist()]
        ndim = meta[0]
        obj = cls.__new__(cls)
        obj.group = group
        obj.num_parts = dist.get_world_size(group=group)
        obj.rank = dist.get_rank(group=group)
        obj.orig_size = meta[1:1 + ndim]
        if meta[1 + ndim] != obj.num_parts:
            raise ValueError(f"PartitionedTensor meta is for {meta[1 + ndim]} parts, the group has {obj.num_parts}")
        obj.partition = meta[2 + ndim:]
        obj.orig_device = torch.device(device)
        obj.local_data = local_part
        obj.even_split = obj.partition[-1] % obj.num_parts == 0
        return obj

    def to_meta(self):
        values = [len(self.orig_size)] + self.orig_size + [self.num_parts] + list(self.partition)
        return torch.tensor(values, dtype=torch.long, device=self.local_data.device)

    def full(self, device=None):
        """The whole tensor, gathered from every rank of the group (a collective)."""
        device = self.local_data.device if device is None else device
        width = max(self.partition[i + 1] - self.partition[i] for i in range(self.num_parts))
        padded = torch.zeros(width, dtype=self.local_data.dtype, device=self.local_data.device)
        padded[:self.local_data.numel()].copy_(self.local_data)
        gathered = [torch.empty_like(padded) for _ in range(self.num_parts)]
        dist.all_gather(gathered, padded, group=self.group)
        parts = [gathered[i][:self.partition[i + 1] - self.partition[i]] for i in range(self.num_parts)]
        return torch.cat(parts).view(self.orig_size).to(device)

    def data(self):
        return self.local_data

    def local_size(self):
        return self.local_data.size()

    def full_size(self):
        return self.orig_size


#########################################
# Memory, seeds, files, misc
#########################################


def set_random_seed(seed):
    """Seed Python's ``random``, numpy (mod 2**32) and torch (mod 2**63)."""
    import random

    import numpy
    random.seed(seed)
    numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))


def empty_cache():
    """Release the accelerator's cached memory and reset its peak counters."""
    get_accelerator().empty_cache()
    get_accelerator().reset_peak_memory_stats()


def see_memory_usage(message, force=False):
    """With ``force``, print device and host memory use on rank 0 (and reset the peak counters)."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    accel = get_accelerator()
    gib = 1024**3
    print(message)
    print(f"MA {accel.memory_allocated() / gib:.2f} GB Max_MA {accel.max_memory_allocated() / gib:.2f} GB "
          f"CA {accel.memory_reserved() / gib:.2f} GB Max_CA {accel.max_memory_reserved() / gib:.2f} GB")
    try:
        import psutil
        vm = psutil.virtual_memory()
        print(f"CPU Virtual Memory:  used = {(vm.total - vm.available) / gib:.2f} GB, percent = {vm.percent}%")
    except ImportError:
        pass
    accel.reset_peak_memory_stats()


def memory_status(msg, print_rank=-1, reset_max=False):
    """Print this rank's allocated and reserved device memory and the change since the last call."""
    global mem_alloced, mem_cached
    rank = dist.get_rank() if dist.is_initialized() else 0
    if print_rank != -1 and rank != print_rank:
        return
    accel = get_accelerator()
    accel.synchronize()
    if reset_max:
        accel.reset_peak_memory_stats()
    alloced, cached = accel.memory_allocated(), accel.memory_reserved()
    gib = 1024**3
    print(f"RANK={rank} MEMSTATS {msg} device={accel.current_device_name()} current alloc={alloced / gib:0.4f}GB "
          f"(delta={(alloced - mem_alloced) / gib:0.4f}GB max={accel.max_memory_allocated() / gib:0.4f}GB) "
          f"current cache={cached / gib:0.4f}GB (delta={(cached - mem_cached) / gib:0.4f}GB "
          f"max={accel.max_memory_reserved() / gib:0.4f}GB)")
    mem_alloced, mem_cached = alloced, cached


def get_ma_status():
    """Allocated device memory on rank 0 (0 on the other ranks)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0
    return get_accelerator().memory_allocated()


def ensure_directory_exists(filename):
    """Create the directory that will hold ``filename``."""
    os.makedirs(os.path.dirname(filename), exist_ok=True)


def _get_folder_size(folder):
    return sum(os.path.getsize(os.path.join(path, f)) for path, _, files in os.walk(folder) for f in files)


def get_checkpoint_folder_size(save_dir, tag, local_rank=None):
    """Bytes under ``save_dir/tag``, measured on local rank 0 and summed onto global rank 0 (a collective)."""
    size = _get_folder_size(os.path.join(save_dir, tag)) if local_rank == 0 else 0
    device = get_accelerator().current_device_name()
    total = torch.tensor(size, dtype=torch.long, device=device)
    if dist.is_initialized():
        dist.reduce(total, dst=0)
    return int(total)


def call_to_str(base, *args, **kwargs):
    """``"base(1, 'a', key=2)"``: the call as a string, values in ``repr``."""
    pieces = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(pieces)})"


def get_only_unique_item(items):
    """The one value ``items`` holds (every item equal); ``RuntimeError`` otherwise."""
    distinct = set(items)
    if len(distinct) != 1:
        raise RuntimeError(f"expected there to be only one unique element in {items}")
    return next(iter(distinct))


def noop_decorator(func):
    return func


class noop_context:
    """A context manager that does nothing."""

    def __enter__(self):
        return None

    def __exit__(self, exc_type, exc_val, exc_tb):
        return False


def _make_offload_state_key(key):
    return f"{key}_offload_buffer"


def offload_adam_states(optimizer, device, pin_memory: bool = False, non_blocking: bool = False):
    """Move ``exp_avg`` / ``exp_avg_sq`` of every state to ``device`` in place: ``.data`` goes through a buffer kept in
    the state under ``<key>_offload_buffer``, so the state tensors stay the same objects."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                continue
            buffer_key = _make_offload_state_key(key)
            if buffer_key not in state:
                buffer = torch.empty_like(state[key], device=device)
                state[buffer_key] = get_accelerator().pin_memory(buffer) if pin_memory else buffer
            state[buffer_key].copy_(state[key], non_blocking=non_blocking)
            state[key].data = state[buffer_key]


def reload_adam_states(optimizer, device, non_blocking: bool = False):
    """Move ``exp_avg`` / ``exp_avg_sq`` back to ``device`` in place (after :func:`offload_adam_states`)."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key].data = state[_make_offload_state_key(key)].to(device, non_blocking=non_blocking)
