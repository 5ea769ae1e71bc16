# SPDX-License-Identifier: Apache-2.0
"""Gating, capacity, dispatch and combine of a mixture-of-experts layer, with experts spread over ranks.

Gating works on probabilities: ``gates = softmax(logits)`` in float32, and the top-k choices are
taken on ``gates`` (never on raw logits plus something else, except where a noisy policy asks for
sampling). Per token ``s`` and choice ``j`` a route is ``(expert, location, weight, kept)``:

* **capacity** (``drop_tokens``): every expert takes at most
  ``C = max(ceil(k * S / E * capacity_factor), min_capacity)`` tokens of this rank's ``S``,
  and never more than ``S`` (an expert cannot get a token twice, so a larger buffer would only
  hold padding). Without ``drop_tokens`` ``C`` is the largest expert load, agreed (max) over the
  expert-parallel group so that the all-to-all chunks have one size;
* **which tokens stay**: top-1 keeps the first ``C`` tokens of an expert in token order, or a
  random ``C`` of them with ``use_rts``; top-2 places the second choices after every first choice
  (``location2 += count1``); top-k keeps, per expert, the ``C`` tokens with the highest gate;
* **weights**: top-1 the kept token's gate; top-2 and top-k the kept gates renormalised to sum
  to one per token;
* **aux loss** (load balancing): with ``me`` the mean gate per expert and ``ce`` the share of
  first choices (top-1, top-2) or of all ``k`` choices divided by ``k`` (top-k),
  ``l_aux = E * sum(me * ce)``, counted before any token is dropped; ``exp_counts`` are the
  routes per expert, before dropping.

Locations and slot numbers are int64 throughout: ``E * C * d_model`` exceeds int32 at 64
experts and realistic sequence lengths.

Dispatch is sparse: a kept route writes its token into slot ``expert * C + location`` of an
``[E, C, d_model]`` buffer (padding stays zero), the buffer is exchanged over the
expert-parallel group (all-to-all: ``E = ep_size * num_local_experts``, expert ``e`` lives on
expert-parallel rank ``e // num_local_experts``), the local experts run on their
``ep_size * C`` slots, the results come back by the reverse all-to-all, and each token sums
``weight * output`` over its kept routes. A dropped token's output is zero (the residual
connection around the layer, if the model has one, carries it). The ``[S, E, C]``
``combine_weights`` / ``dispatch_mask`` tensors upstream's gating functions return are built
only by those functions (:func:`top1gating` ...), not on the layer's path.
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import deepspeed.comm as dist
from deepspeed.utils.logging import logger

# Upstream's flag for its optional Tutel kernels; the layer never uses them (``use_tutel`` warns).
TUTEL_INSTALLED = False

TOPK_GATE_TIMER = "topk_gate"
MOE_TIMER = "moe"
FIRST_ALLTOALL_TIMER = "1st_a2a"
SECOND_ALLTOALL_TIMER = "2nd_a2a"


def multiplicative_jitter(x, device: torch.device, epsilon=1e-2):
    """``x`` times noise uniform in ``[1 - epsilon, 1 + epsilon]`` (the 'Jitter' gate policy)."""
    if epsilon == 0:
        return x
    noise = torch.empty_like(x, device=device).uniform_(1.0 - epsilon, 1.0 + epsilon)
    return x * noise


def gumbel_rsample(shape: Tuple, device: torch.device) -> Tensor:
    """Standard Gumbel noise of ``shape`` (the 'RSample' policy and top-2's second-expert sampling)."""
    u = torch.rand(shape, device=device).clamp_(min=1e-20, max=1.0 - 1e-7)
    return -torch.log(-torch.log(u))


class _AllToAll(torch.autograd.Function):
    """An equal-split all-to-all over ``group`` along dim 0; its backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, group, input):
        ctx.group = group
        return _all_to_all(group, input)

    @staticmethod
    def backward(ctx, grad_output):
        return None, _all_to_all(ctx.group, grad_output)


def _all_to_all(group, tensor, send_counts=None, recv_counts=None):
    """Rows of ``tensor`` exchanged over ``group``: an equal split along dim 0, or rows
    ``sum(send_counts[:j]) ...`` to rank ``j`` with ``recv_counts`` rows received from each (rank order)."""
    send = tensor.contiguous()
    if send.dtype in (torch.bfloat16, torch.float16) and torch.distributed.get_backend(group) == "gloo":
        send = send.float()  # gloo's all-to-all may lack 16-bit types; the round trip is exact
    if recv_counts is None:
        out = torch.empty_like(send)
    else:
        out = send.new_empty((sum(recv_counts), ) + tuple(send.shape[1:]))
    dist.all_to_all_single(out,
                           send,
                           output_split_sizes=None if recv_counts is None else list(recv_counts),
                           input_split_sizes=None if send_counts is None else list(send_counts),
                           group=group)
    return out.to(tensor.dtype)


def _capacity(num_tokens, num_experts, k, capacity_factor, min_capacity):
    """Slots per expert (module docstring): at least ``min_capacity``, at most ``num_tokens``, at least 1."""
    capacity = int(math.ceil(k * num_tokens / num_experts * float(capacity_factor)))
    capacity = max(capacity, int(min_capacity))
    return max(1, min(capacity, num_tokens)) if num_tokens > 0 else max(1, int(min_capacity))


@dataclass
class Routes:
    """The routes of ``S`` tokens, ``k`` each (module docstring); every tensor is ``[S, k]``."""
    experts: Tensor  # int64 expert index
    locations: Tensor  # int64 position in the expert's buffer (meaningful where kept)
    weights: Tensor  # float32 combine weight (0 where dropped)
    kept: Tensor  # bool
    capacity: int
    num_experts: int
    l_aux: Tensor
    exp_counts: Tensor

    def slots(self):
        """``(token index, slot = expert * C + location, weight)`` of every kept route, int64 slots."""
        tokens = torch.arange(self.experts.shape[0], device=self.experts.device).unsqueeze(1).expand_as(self.kept)
        keep = self.kept
        return tokens[keep], self.experts[keep] * self.capacity + self.locations[keep], self.weights[keep]

    def sparse(self):
        """Upstream's ``sparse_routes=True`` gating output: ``(l_aux, capacity, num_experts, indices, locations,
        gates, exp_counts)`` with ``[k, S]`` route tensors: int32 expert (-1 where the route was dropped), int32
        location (0 where dropped), float32 weight (0 where dropped)."""
        indices = torch.where(self.kept, self.experts, torch.full_like(self.experts, -1))
        locations = self.locations * self.kept
        return (self.l_aux, self.capacity, self.num_experts, indices.t().to(torch.int32),
                locations.t().to(torch.int32), self.weights.t().contiguous(), self.exp_counts)

    def dense(self):
        """``(combine_weights, dispatch_mask)``, both ``[S, E, C]`` (upstream's gating outputs)."""
        S = self.experts.shape[0]
        tokens, slots, weights = self.slots()
        combine = torch.zeros(S, self.num_experts * self.capacity, dtype=self.weights.dtype, device=weights.device)
        combine = combine.index_put((tokens, slots), weights, accumulate=True)
        combine = combine.view(S, self.num_experts, self.capacity)
        dispatch = torch.zeros(S, self.num_experts * self.capacity, dtype=torch.bool, device=weights.device)
        dispatch[tokens, slots] = True
        return combine, dispatch.view(S, self.num_experts, self.capacity)


def _agreed_capacity(counts, ep_group):
    capacity = counts.max().to(torch.int64).reshape(1)
    if ep_group is not None and dist.is_initialized() and dist.get_world_size(ep_group) > 1:
        dist.all_reduce(capacity, op=dist.ReduceOp.MAX, group=ep_group)
    return max(1, int(capacity.item()))


def _positions(mask):
    """``cumsum - 1`` over tokens of a ``[S, E]`` 0/1 mask: each route's place in its expert's queue (int64)."""
    return torch.cumsum(mask.to(torch.int64), dim=0) - 1


def route_top1(logits,
               capacity_factor,
               min_capacity,
               used_token=None,
               noisy_gate_policy=None,
               drop_tokens=True,
               use_rts=True,
               ep_group=None):
    """Top-1 routes (module docstring); ``logits`` ``[S, E]``."""
    logits = logits.float()
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    chooser = logits + gumbel_rsample(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    index = torch.argmax(chooser, dim=1)
    mask = F.one_hot(index, num_classes=E)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * E
    capacity = _capacity(S, E, 1, capacity_factor, min_capacity) if drop_tokens else _agreed_capacity(
        exp_counts, ep_group)
    if use_rts and drop_tokens:
        # Random token selection: an expert keeps the tokens with the highest random priority.
        priority = torch.rand(S, device=logits.device).unsqueeze(1).expand(S, E).masked_fill(mask == 0, -1.0)
        order = torch.argsort(priority, dim=0, descending=True, stable=True)
        rank_in_expert = torch.empty_like(order)
        rank_in_expert.scatter_(0, order, torch.arange(S, device=logits.device).unsqueeze(1).expand(S, E))
        keep_mask = mask.bool() & (rank_in_expert < capacity)
    else:
        keep_mask = mask.bool() & (_positions(mask) < capacity)
    locations = _positions(keep_mask)
    kept = keep_mask.any(dim=1, keepdim=True)
    location = locations.gather(1, index.unsqueeze(1))
    weight = gates.gather(1, index.unsqueeze(1)) * kept
    return Routes(index.unsqueeze(1), location, weight, kept, capacity, E, l_aux, exp_counts)


def route_top2(logits, capacity_factor, min_capacity, drop_tokens=True, ep_group=None, sample_second=False):
    """Top-2 routes (module docstring); ``sample_second``: the second expert from logits plus Gumbel noise."""
    logits = logits.float()
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    index1 = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(index1, num_classes=E)
    chooser = logits + gumbel_rsample(logits.shape, logits.device) if sample_second else gates
    index2 = torch.argmax(chooser.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(index2, num_classes=E)
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    l_aux = torch.sum(gates.mean(dim=0) * mask1.float().mean(dim=0)) * E
    capacity = _capacity(S, E, 2, capacity_factor, min_capacity) if drop_tokens else _agreed_capacity(
        exp_counts, ep_group)
    loc1 = _positions(mask1)
    loc2 = _positions(mask2) + mask1.sum(dim=0, keepdim=True)
    keep1 = (mask1.bool() & (loc1 < capacity)).any(dim=1)
    keep2 = (mask2.bool() & (loc2 < capacity)).any(dim=1)
    l1 = loc1.gather(1, index1.unsqueeze(1)).squeeze(1)
    l2 = loc2.gather(1, index2.unsqueeze(1)).squeeze(1)
    g1 = gates.gather(1, index1.unsqueeze(1)).squeeze(1) * keep1
    g2 = gates.gather(1, index2.unsqueeze(1)).squeeze(1) * keep2
    denom = torch.clamp(g1 + g2, min=torch.finfo(torch.float32).eps)
    return Routes(torch.stack([index1, index2], 1), torch.stack([l1, l2], 1), torch.stack([g1 / denom, g2 / denom], 1),
                  torch.stack([keep1, keep2], 1), capacity, E, l_aux, exp_counts)


def route_topk(logits, k, capacity_factor, min_capacity, drop_tokens=True, ep_group=None, drop_policy="probs"):
    """Top-k routes (module docstring): the ``k`` highest probabilities; per expert the best-``C`` tokens stay."""
    logits = logits.float()
    S, E = logits.shape
    if not 1 <= k <= E:
        raise ValueError(f"top-k gating needs 1 <= k <= num_experts, got k={k}, num_experts={E}")
    gates = F.softmax(logits, dim=1)
    top_gate, top_index = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_index, True)
    exp_counts = mask.sum(dim=0).detach().to(torch.int64)
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * E / k
    if drop_tokens:
        capacity = _capacity(S, E, k, capacity_factor, min_capacity)
        if drop_policy == "probs":
            scores = torch.zeros_like(gates).scatter(1, top_index, top_gate).masked_fill(~mask, -1.0)
            best = torch.topk(scores, k=min(capacity, S), dim=0).indices
            mask = mask & torch.zeros_like(mask).scatter_(0, best, True)
        elif drop_policy == "position":
            mask = mask & (_positions(mask) < capacity)
        else:
            raise ValueError(f"drop_policy must be 'probs' or 'position', got {drop_policy!r}")
    else:
        capacity = _agreed_capacity(exp_counts, ep_group)
    locations = _positions(mask)
    kept = mask.gather(1, top_index)
    weights = top_gate * kept
    weights = weights / torch.clamp(weights.sum(dim=1, keepdim=True), min=torch.finfo(torch.float32).eps)
    return Routes(top_index, locations.gather(1, top_index), weights, kept, capacity, E, l_aux, exp_counts)


def top1gating(logits: Tensor,
               capacity_factor: float,
               min_capacity: int,
               used_token: Tensor = None,
               noisy_gate_policy: Optional[str] = None,
               drop_tokens: bool = True,
               use_rts: bool = True,
               ep_group=None,
               sparse_routes: bool = False,
               use_tutel: bool = False):
    """``(l_aux, combine_weights [S, E, C], dispatch_mask [S, E, C], exp_counts)`` of top-1 gating, or with
    ``sparse_routes`` the routes themselves (:meth:`Routes.sparse`)."""
    r = route_top1(logits, capacity_factor, min_capacity, used_token, noisy_gate_policy, drop_tokens, use_rts,
                   ep_group)
    if sparse_routes:
        return r.sparse()
    combine, dispatch = r.dense()
    return r.l_aux, combine, dispatch, r.exp_counts


def top2gating(logits: Tensor,
               capacity_factor: float,
               min_capacity: int,
               drop_tokens: bool = True,
               ep_group=None,
               top2_2nd_expert_sampling: bool = True,
               sparse_routes: bool = False):
    """``(l_aux, combine_weights, dispatch_mask, exp_counts)`` of top-2 gating (``sparse_routes``: the routes)."""
    r = route_top2(logits, capacity_factor, min_capacity, drop_tokens, ep_group, top2_2nd_expert_sampling)
    if sparse_routes:
        return r.sparse()
    combine, dispatch = r.dense()
    return r.l_aux, combine, dispatch, r.exp_counts


def topkgating(logits: Tensor,
               k: int,
               capacity_factor: float,
               min_capacity: int,
               drop_tokens: bool = True,
               ep_group=None,
               drop_policy: str = "probs",
               sparse_routes: bool = False):
    """``(l_aux, combine_weights, dispatch_mask, exp_counts)`` of top-k gating (``sparse_routes``: the routes)."""
    r = route_topk(logits, k, capacity_factor, min_capacity, drop_tokens, ep_group, drop_policy)
    if sparse_routes:
        return r.sparse()
    combine, dispatch = r.dense()
    return r.l_aux, combine, dispatch, r.exp_counts


# Upstream's dispatch helpers over the sparse routes ([k, S] tensors of Routes.sparse()). A dropped route goes to
# one extra scratch slot ``E * C``, which the dispatch never reads.


def _route_slots(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """``[k, S]`` int64 slot ``expert * C + location`` of every route; ``E * C`` (the scratch slot) if dropped."""
    slots = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, slots, torch.full_like(slots, num_experts * capacity))


def _sparse_encode(tokens: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """The ``[E, C, d_model]`` dispatch buffer: each kept route's token in its slot, zeros elsewhere."""
    k = slots.shape[0]
    buffer = tokens.new_zeros(num_experts * capacity + 1, tokens.shape[-1])
    buffer = buffer.index_put((slots.reshape(-1), ), tokens.repeat(k, 1))
    return buffer[:-1].view(num_experts, capacity, tokens.shape[-1])


def _sparse_decode(expert_output: Tensor, slots: Tensor, gates: Tensor, num_tokens: int) -> Tensor:
    """``[S, d_model]``: each token's sum over its routes of ``gate * output[slot]`` (dropped routes add nothing),
    accumulated in float32 at least and returned in the experts' dtype."""
    padded = torch.cat([expert_output, expert_output.new_zeros(1, expert_output.shape[-1])])
    routed = padded.index_select(0, slots.reshape(-1)).view(slots.shape[0], num_tokens, -1)
    acc = torch.promote_types(expert_output.dtype, torch.float32)
    return (routed.to(acc) * gates.to(acc).unsqueeze(-1)).sum(0).to(expert_output.dtype)


class TopKGate(nn.Module):
    """The router: a bias-free float32 linear map to ``num_experts`` logits, then top-k routes on probabilities."""

    def __init__(self,
                 model_dim: int,
                 num_experts: int,
                 k: int = 1,
                 capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0,
                 min_capacity: int = 8,
                 noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True,
                 use_rts: bool = True,
                 ep_group=None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"TopKGate: k={k} must be between 1 and num_experts={num_experts}")
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ValueError(f"noisy_gate_policy must be None, 'Jitter' or 'RSample', got {noisy_gate_policy!r}")
        self.wg = nn.Linear(model_dim, num_experts, bias=False).float()
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0

    def _set_ep_group(self, ep_group):
        self.ep_group = ep_group

    def routes(self, input: Tensor, used_token: Tensor = None) -> Routes:
        """The routes of ``input`` ``[S, d_model]`` (the float32 router runs on a float32 copy)."""
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x, device=x.device)
        logits = F.linear(x, self.wg.weight.float())
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return route_top1(logits, cf, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts
                              and self.training, self.ep_group)
        if self.k == 2:
            return route_top2(logits, cf, self.min_capacity, self.drop_tokens, self.ep_group,
                              self.top2_2nd_expert_sampling and self.training)
        return route_topk(logits, self.k, cf, self.min_capacity, self.drop_tokens, self.ep_group)

    def forward(self, input: Tensor, used_token: Tensor = None, sparse_routes: bool = False, use_tutel: bool = False):
        """``(l_aux, combine_weights, dispatch_mask, exp_counts)``, as upstream's gate returns them (with
        ``sparse_routes``: :meth:`Routes.sparse`)."""
        r = self.routes(input, used_token)
        if sparse_routes:
            return r.sparse()
        combine, dispatch = r.dense()
        return r.l_aux, combine.to(input.dtype), dispatch, r.exp_counts


class MOELayer(nn.Module):
    """Gate, dispatch over the expert-parallel group, local experts, combine (module docstring)."""

    def __init__(self,
                 gate: TopKGate,
                 experts: nn.Module,
                 ep_group_name,
                 ep_size,
                 num_local_experts: int,
                 use_tutel: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.time_falltoall = 0.0
        self.time_salltoall = 0.0
        self.time_moe = 0.0
        self.wall_clock_breakdown = False
        self.l_aux = None
        self.exp_counts = None
        if use_tutel:
            logger.warning("MoE use_tutel=True: Tutel kernels are not used by this runtime; the layer dispatches "
                           "with its own sparse all-to-all (same results)")
        self.use_tutel = False

    def _set_ep_group(self, ep_group):
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def forward(self, *input: Tensor, **kwargs) -> Tensor:
        hidden = input[0]
        d_model = hidden.shape[-1]
        tokens_in = hidden.reshape(-1, d_model)
        used_token = input[1] if len(input) > 1 else kwargs.get("used_token")
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(f"MoE layer with ep_size={self.ep_size} ran before its expert-parallel group "
                               f"'{self.ep_group_name}' exists: build the engine with deepspeed.initialize first "
                               f"(or call the MoE module's set_deepspeed_parallelism())")
        routes = self.gate.routes(tokens_in, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        E, C = routes.num_experts, routes.capacity
        token_index, slots, weights = routes.slots()
        buffer = torch.zeros(E * C, d_model, dtype=tokens_in.dtype, device=tokens_in.device)
        buffer = buffer.index_copy(0, slots, tokens_in.index_select(0, token_index))
        dispatched = buffer.view(E, C, d_model)
        if self.ep_size > 1:
            dispatched = _AllToAll.apply(self.ep_group, dispatched)
        # [ep source, local expert, C, d]: each local expert sees ep_size * C slots
        expert_in = dispatched.reshape(self.ep_size, self.num_local_experts, C, d_model)
        expert_out = self.experts(expert_in)
        if self.ep_size > 1:
            expert_out = _AllToAll.apply(self.ep_group, expert_out.contiguous())
        expert_out = expert_out.reshape(E * C, -1)
        picked = expert_out.index_select(0, slots) * weights.to(expert_out.dtype).unsqueeze(1)
        combined = torch.zeros(tokens_in.shape[0], picked.shape[1], dtype=picked.dtype, device=picked.device)
        combined = combined.index_add(0, token_index, picked)
        return combined.reshape(hidden.shape[:-1] + (combined.shape[-1], ))
