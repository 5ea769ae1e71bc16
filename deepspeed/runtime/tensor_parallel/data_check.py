# SPDX-License-Identifier: Apache-2.0
"""The first forward of a tensor-parallel model: the group's inputs must be the same, and the replicated
parameters' kinds are confirmed.

Every rank of a tensor-parallel group computes on the same samples; a data loader that gives
them different ones (sharding by global rank instead of by data-parallel rank) trains a wrong
model silently. :class:`FirstForwardCheck` is a forward pre-hook on the model that runs once:

1. the ranks of each tensor-parallel group compare their inputs: a description of them (the
   structure, each tensor's shape and dtype, the other values) is all-gathered over the group,
   and, when the descriptions agree, each tensor is broadcast from the group's first rank and
   compared; the verdict is combined over the whole world, so that every rank raises upstream's
   ``AssertionError`` ("Data inconsistency within the TP group. ...") together, before the
   forward's collectives;
2. when the replicated parameters' kinds could not be traced at ``initialize`` (a model whose
   inputs could not be made up), this forward is traced (``replicated.ShardFlow``) and the kinds
   the gradient reduction was built with are checked against it: a parameter that acts on sharded
   activations but was marked ``"mean"`` (or the reverse) raises on every rank before the
   backward, with the name to put in ``partition_config`` (``grad_allreduce``).
"""

import torch
from torch.utils._pytree import tree_flatten

import deepspeed.comm as dist
from deepspeed.runtime.tensor_parallel import replicated

MESSAGE = "Data inconsistency within the TP group. Please check the Dataloader implementation to ensure consistency."


def _describe(obj):
    leaves, spec = tree_flatten(obj)
    out = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append(("tensor", tuple(leaf.shape), str(leaf.dtype)))
        else:
            out.append(("value", repr(leaf)))
    return out, [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def inputs_agree(args, kwargs, group, src, device):
    """Whether every rank of ``group`` got the same ``args``/``kwargs`` (a collective over ``group``)."""
    description, tensors = _describe((args, kwargs))
    described = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(described, description, group=group)
    if any(d != description for d in described):
        return False
    same = True
    for tensor in tensors:
        staged = tensor.detach().to(device).contiguous().clone()
        dist.broadcast(staged, src=src, group=group)
        same = same and torch.equal(staged, tensor.detach().to(device))
    return same


class FirstForwardCheck:
    """The pre-hook of the module docstring (``trace``: also trace the forward and check the kinds)."""

    def __init__(self, module, group, src, device, trace=False):
        self.group, self.src, self.device = group, src, device
        self.flow = replicated.ShardFlow(module) if trace else None
        self.expected = {n: replicated.kind_of(p) for n, p in module.named_parameters()} if trace else None
        self._pre = module.register_forward_pre_hook(self._before, prepend=True, with_kwargs=True)
        self._post = None
        self._tracing = False

    def _before(self, module, args, kwargs):
        self._pre.remove()
        same = inputs_agree(args, kwargs, self.group, self.src, self.device)
        verdict = torch.tensor([1.0 if same else 0.0], device=self.device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN)  # every rank raises if any group disagrees
        if verdict.item() < 1.0:
            raise AssertionError(MESSAGE)
        if self.flow is not None:
            self._post = module.register_forward_hook(self._after, always_call=True)
            self.flow.__enter__()
            self._tracing = True

    def _after(self, module, args, output):
        self._post.remove()
        if not self._tracing:
            return
        self._tracing = False
        self.flow.__exit__(None, None, None)
        traced = self.flow.kinds()
        wrong = sorted(n for n, kind in traced.items() if self.expected.get(n) not in (None, kind))
        flag = torch.tensor([1.0 if wrong else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            sums = [n for n in wrong if traced[n] == replicated.SUM]
            raise ValueError(f"AutoTP: the replicated parameters {wrong[:4]} act on activations "
                             f"{'cut over' if sums else 'replicated over'} the tensor-parallel group, but their "
                             f"gradient reduction was built for the other kind (the model's inputs could not be made "
                             f"up at initialize, so the kinds came from the rules); mark "
                             f"{'them' if sums else 'the others'} with 'grad_allreduce': true in a 'skip' layer spec "
                             f"of tensor_parallel.partition_config")

    def remove(self):
        self._pre.remove()
        if self._post is not None:
            self._post.remove()
        if self._tracing:
            self.flow.__exit__(None, None, None)
            self._tracing = False
