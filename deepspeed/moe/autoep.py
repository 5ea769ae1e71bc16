# SPDX-License-Identifier: Apache-2.0
"""AutoEP: an unmodified Hugging Face MoE model trains with its experts sharded over expert-parallel ranks.

The config section ``expert_parallel`` (upstream's keys, :mod:`deepspeed.moe.autoep_config`) makes
``deepspeed.initialize`` replace, in every sparse MoE block of the model (the preset's block class,
:mod:`deepspeed.moe.autoep_presets`), the ``experts`` module by :class:`GroupedExperts`: this rank's
``num_experts / autoep_size`` experts (slices of the model's ``gate_up_proj`` / ``down_proj``, marked as
expert parameters of ``ep_size_<ep>``). The block's router, its shared experts and its ``forward`` are left
as they are, so the routing is the model's own, bit for bit, and the router logits stay visible to
``output_router_logits``; where the config's routing keys ask for other routing, the router routes through
:mod:`deepspeed.moe.autoep_router` (same parameters and module).

:class:`GroupedExperts` is dropless: every route ``(token, expert, weight)`` the router chose
is computed. Routes are sorted by expert; with ``autoep_size > 1`` the tokens travel to the rank
holding their expert and back through two all-to-alls of variable sizes over the
expert-parallel group (the counts per expert are exchanged first); each local expert runs on its
contiguous rows, by one grouped matrix multiply per projection (``torch.nn.functional.grouped_mm``
on CUDA with ``use_grouped_mm``) or a loop over experts; the token's output is the sum of its
routes' outputs times their weights (``score_apply: pre``: the weights scale the inputs instead).
A rank whose experts receive no token takes part in both exchanges with empty chunks and
contributes a zero gradient.

Bad input is an error on every rank before any collective: an unknown ``preset_model`` or one
that does not match the model, a model without sparse MoE blocks, ``num_experts`` not divisible
by ``autoep_size``, ``autoep_size`` not dividing the world, a routing that cannot be computed. ZeRO-3 takes
experts of every ``autoep_size`` with every ZeRO-3 feature (offload, ZeRO++, ZenFlow; docs/moe.md).
"""

import re

import torch
import torch.nn.functional as F
from torch import nn

import deepspeed.comm as dist
from deepspeed.moe.autoep_config import AutoEPConfig
from deepspeed.moe.autoep_presets import PRESETS, check_block_keys, own_routing, requested_routing
from deepspeed.moe.autoep_router import install_routing
from deepspeed.moe.fused_expert_layout import classify_fused_gate_up_layout
from deepspeed.moe.sharded_moe import _all_to_all
from deepspeed.moe.utils import mark_expert_param
from deepspeed.runtime.zero.partition_parameters import GatheredParameters, is_zero_param
from deepspeed.utils import groups


def _model_type(model):
    return getattr(getattr(model, "config", None), "model_type", None)


def _sparse_blocks(model, class_name, pattern=None):
    """``(name, module)`` of every block of ``class_name`` (whose name fully matches ``pattern``, when given)."""
    rx = re.compile(pattern) if pattern is not None else None
    return [(name, module) for name, module in model.named_modules()
            if type(module).__name__ == class_name and (rx is None or rx.fullmatch(name))]


def resolve_preset(model, cfg):
    """The preset name for ``model`` (the configured one, checked, or the one its ``model_type`` names)."""
    model_type = _model_type(model)
    for name, preset in PRESETS.items():
        for refused_type, why in preset.unsupported_model_types:
            if model_type == refused_type and cfg.preset_model in (None, name):
                raise ValueError(f"AutoEP preset '{name}' does not serve model_type {model_type!r}: {why}")
    if cfg.preset_model is not None:
        preset = PRESETS[cfg.preset_model]
        if model_type not in preset.model_types or not _sparse_blocks(model, preset.block):
            raise ValueError(f"expert_parallel.preset_model='{cfg.preset_model}' does not match the model "
                             f"(model_type {model_type!r}, {type(model).__name__}): it expects model_type in "
                             f"{list(preset.model_types)} with {preset.block} modules")
        return cfg.preset_model
    for name, preset in PRESETS.items():
        if model_type in preset.model_types and _sparse_blocks(model, preset.block):
            return name
    if cfg.moe_layer_pattern is not None:
        raise NotImplementedError(f"config key 'expert_parallel.moe_layer_pattern' on a model that matches no preset "
                                  f"(model_type {model_type!r}): upstream's custom preset, which replaces the whole "
                                  f"block by its own, is not supported; presets: {sorted(PRESETS)} (docs/moe.md)")
    raise ValueError(f"expert_parallel is enabled but the model (model_type {model_type!r}, {type(model).__name__}) "
                     f"matches no AutoEP preset; supported: {sorted(PRESETS)}")


def num_experts_of(model, cfg, preset):
    """The model's number of routed experts (``num_experts_attr`` when set, else the preset's attribute)."""
    attr = cfg.num_experts_attr or PRESETS[preset].num_experts_attr
    if not hasattr(model.config, attr):
        raise ValueError(f"expert_parallel.num_experts_attr={attr!r}: the model config has no such attribute")
    return int(getattr(model.config, attr))


def block_plan(model, cfg, preset):
    """``[(name, block, routing or None)]``: the blocks AutoEP shards and, where the config asks for routing other
    than the model's own, the :class:`RoutingSpec` to route with."""
    blocks = _sparse_blocks(model, PRESETS[preset].block, cfg.moe_layer_pattern)
    if not blocks:
        raise ValueError(f"expert_parallel.moe_layer_pattern={cfg.moe_layer_pattern!r} matches none of the "
                         f"model's {PRESETS[preset].block} modules")
    num_experts = num_experts_of(model, cfg, preset)
    own = own_routing(preset, model.config)
    spec = requested_routing(own, cfg, model.config, num_experts)
    plan = []
    for name, block in blocks:
        held = int(_whole_shape(block.experts.gate_up_proj)[0])
        if held != num_experts:
            raise ValueError(f"AutoEP: block '{name}' holds {held} experts, the model config says {num_experts}")
        plan.append((name, block, None if spec == own else spec))
    return plan


def _whole_shape(param):
    """A parameter's shape, whole even where ``zero.Init`` partitioned it."""
    return param.ds_shape if is_zero_param(param) else param.shape


def check_autoep(model, cfg, world_size, zero_stage, sequence_parallel_size=1):
    """Every check that needs no collective (module docstring); returns the preset name."""
    preset = resolve_preset(model, cfg)
    check_block_keys(cfg, preset)
    block_plan(model, cfg, preset)
    num_experts = num_experts_of(model, cfg, preset)
    ep = cfg.autoep_size
    if num_experts % ep != 0:
        raise ValueError(f"expert_parallel.autoep_size={ep} must divide the model's number of experts "
                         f"({cfg.num_experts_attr or PRESETS[preset].num_experts_attr}={num_experts})")
    if world_size % ep != 0:
        raise ValueError(f"expert_parallel.autoep_size={ep} must divide the world size ({world_size})")
    return preset


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


# upstream's expert_activation names this release computes: act(gate) * up
_ACTIVATIONS = {"swiglu": F.silu, "geglu_tanh": _gelu_tanh}


class _AllToAllV(torch.autograd.Function):
    """A variable-size all-to-all of rows; backward sends the gradient rows back the way they came."""

    @staticmethod
    def forward(ctx, group, tensor, send_counts, recv_counts):
        ctx.group, ctx.send_counts, ctx.recv_counts = group, send_counts, recv_counts
        return _all_to_all(group, tensor, send_counts, recv_counts)

    @staticmethod
    def backward(ctx, grad):
        return None, _all_to_all(ctx.group, grad, ctx.recv_counts, ctx.send_counts), None, None


class _SumRowsInto(torch.autograd.Function):
    """``zeros_like(like).index_add(0, index, rows)``, whose backward keeps ``index`` only.

    Autograd's own ``index_add`` saves ``rows`` for their shape alone (its gradient is ``grad.index_select(0,
    index)``): one ``[tokens * top_k, hidden]`` tensor per MoE layer held until the backward for nothing.
    """

    @staticmethod
    def forward(ctx, like, index, rows):
        ctx.save_for_backward(index)
        return torch.zeros_like(like).index_add_(0, index, rows)

    @staticmethod
    def backward(ctx, grad):
        index, = ctx.saved_tensors
        return None, None, grad.index_select(0, index)


class GroupedExperts(nn.Module):
    """This rank's experts of one sparse MoE block, computed dropless over the expert-parallel group.

    ``forward(hidden_states [T, d], top_k_index [T, k], top_k_weights [T, k])`` has the signature and
    the result of the model's own experts module (module docstring).
    """

    def __init__(self, experts, ep_size, ep_rank, use_grouped_mm=True, score_apply="post", activation=None):
        super().__init__()
        self.score_apply = score_apply
        num_experts = int(experts.num_experts)
        self.num_experts = num_experts
        self.ep_size = int(ep_size)
        self.ep_rank = int(ep_rank)
        self.num_local_experts = num_experts // self.ep_size
        self.first_expert = self.ep_rank * self.num_local_experts
        self.hidden_dim = experts.hidden_dim
        self.intermediate_dim = experts.intermediate_dim
        self.act_fn = _ACTIVATIONS[activation] if activation is not None else experts.act_fn
        self.use_grouped_mm = use_grouped_mm
        self.expert_group_name = groups.expert_group_name(self.ep_size)
        gate_up_shape, down_shape = _whole_shape(experts.gate_up_proj), _whole_shape(experts.down_proj)
        layout = classify_fused_gate_up_layout(gate_up_shape, down_shape)
        if layout is None or layout.layout != "gate_up_first":
            raise NotImplementedError(
                f"AutoEP: the experts' fused weights (gate_up_proj {tuple(gate_up_shape)}, down_proj "
                f"{tuple(down_shape)}) are not in the [E, 2F, H] / [E, H, F] layout this release "
                f"computes ({'layout ' + layout.layout if layout else 'no known layout'}); see docs/moe.md")
        local = slice(self.first_expert, self.first_expert + self.num_local_experts)
        # built under zero.Init, the fused weights are partitioned over every rank: sliced from their whole value (a
        # collective, every rank replacing the same blocks in order); the slices are plain parameters, which the
        # ZeRO-3 engine shards over their expert-data-parallel group
        with torch.no_grad(), GatheredParameters([experts.gate_up_proj, experts.down_proj]):
            self.gate_up_proj = nn.Parameter(experts.gate_up_proj[local].detach().clone(),
                                             requires_grad=experts.gate_up_proj.requires_grad)
            self.down_proj = nn.Parameter(experts.down_proj[local].detach().clone(),
                                          requires_grad=experts.down_proj.requires_grad)
        mark_expert_param(self.gate_up_proj, self.expert_group_name)
        mark_expert_param(self.down_proj, self.expert_group_name)
        self.ep_group = None

    def set_deepspeed_parallelism(self):
        """Take the expert-parallel group from the mesh (the engine calls this once the mesh exists)."""
        if self.ep_size > 1:
            self.ep_group = groups._get_expert_parallel_group(self.expert_group_name)
            if groups._get_expert_parallel_rank(self.expert_group_name) != self.ep_rank:
                raise RuntimeError(f"AutoEP: this rank holds experts of expert-parallel rank {self.ep_rank} but the "
                                   f"mesh places it at {groups._get_expert_parallel_rank(self.expert_group_name)}")

    def _grouped(self, x, counts_device):
        """Local expert ``l`` on its ``counts_device[l]`` contiguous rows of ``x``.

        One grouped matrix multiply per projection on CUDA (no host synchronisation), else a loop
        over the experts that received rows.
        """
        if self.use_grouped_mm and x.is_cuda and hasattr(F, "grouped_mm") and x.dtype == torch.bfloat16:
            offs = torch.cumsum(counts_device, 0).to(torch.int32)
            gate_up = F.grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offs)
            gate, up = gate_up.chunk(2, dim=-1)
            return F.grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)
        counts = counts_device.tolist()
        outs = []
        start = 0
        for local, n in enumerate(counts):
            if n == 0:
                continue
            rows = x.narrow(0, start, n)
            gate, up = F.linear(rows, self.gate_up_proj[local]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[local]))
            start += n
        if not outs:
            # No rows for any local expert: still an empty result *through* the experts, so that the
            # backward reaches the all-to-all below on this rank as it does on its peers.
            rows = x.narrow(0, 0, 0)
            gate, up = F.linear(rows, self.gate_up_proj[0]).chunk(2, dim=-1)
            return F.linear(self.act_fn(gate) * up, self.down_proj[0])
        return torch.cat(outs, 0)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        T, k = top_k_index.shape
        flat = top_k_index.reshape(-1).to(torch.int64)
        order = torch.argsort(flat, stable=True)
        token_of = order // k
        rows = hidden_states.index_select(0, token_of)
        weights = top_k_weights.reshape(-1).index_select(0, order)
        if self.score_apply == "pre":  # the weight scales the expert's input (upstream's "pre"), in float32
            rows = (rows.float() * weights.unsqueeze(1)).to(rows.dtype)
        counts_device = torch.bincount(flat, minlength=self.num_experts)
        if self.ep_size == 1:
            out_rows = self._grouped(rows, counts_device)
        else:
            out_rows = self._exchange_and_compute(rows, counts_device)
        if self.score_apply == "pre":
            weighted = out_rows.to(hidden_states.dtype)
        else:
            weighted = (out_rows * weights.unsqueeze(1)).to(hidden_states.dtype)
        return _SumRowsInto.apply(hidden_states, token_of, weighted)

    def _exchange_and_compute(self, rows, counts_device):
        ep, L = self.ep_size, self.num_local_experts
        per_expert = counts_device.view(ep, L).contiguous()
        received = torch.empty_like(per_expert)
        dist.all_to_all_single(received, per_expert, group=self.ep_group)  # recv[src, l]
        send_counts = per_expert.sum(1).tolist()
        recv_table = received.tolist()
        recv_counts = [sum(r) for r in recv_table]
        got = _AllToAllV.apply(self.ep_group, rows, send_counts, recv_counts)
        # rows arrive source-major; the experts need them expert-major
        starts, at = [], 0
        for src in range(ep):
            row = []
            for local in range(L):
                row.append(at)
                at += recv_table[src][local]
            starts.append(row)
        perm = [
            i for local in range(L) for src in range(ep)
            for i in range(starts[src][local], starts[src][local] + recv_table[src][local])
        ]
        perm_t = torch.tensor(perm, dtype=torch.int64, device=rows.device)
        counts = [sum(recv_table[src][local] for src in range(ep)) for local in range(L)]
        computed = self._grouped(got.index_select(0, perm_t),
                                 torch.tensor(counts, dtype=torch.int64, device=rows.device))
        back = torch.empty_like(perm_t)
        back[perm_t] = torch.arange(perm_t.numel(), device=rows.device)
        source_major = computed.index_select(0, back)
        return _AllToAllV.apply(self.ep_group, source_major, recv_counts, send_counts)


def apply_autoep(model, cfg, ep_rank):
    """Replace the experts of every sparse block of ``model`` by :class:`GroupedExperts` (in place).

    Returns ``{id(old parameter): (old parameter, new parameter)}`` for the optimizer's param groups to follow.
    """
    preset = resolve_preset(model, cfg)
    replaced = {}
    for _, block, routing in block_plan(model, cfg, preset):
        old = block.experts
        score_apply = routing.score_apply if routing is not None else "post"
        new = GroupedExperts(old, cfg.autoep_size, ep_rank, cfg.use_grouped_mm, score_apply, cfg.expert_activation)
        if routing is not None:
            install_routing(block.gate, routing)
        # The old parameter is kept in the entry: an id is only unique while its object lives.
        replaced[id(old.gate_up_proj)] = (old.gate_up_proj, new.gate_up_proj)
        replaced[id(old.down_proj)] = (old.down_proj, new.down_proj)
        block.experts = new
    model._autoep_config = cfg
    return replaced


def _swap(p, replaced):
    entry = replaced.get(id(p))
    return entry[1] if entry is not None and entry[0] is p else p


def remap_params(params, replaced):
    """``params`` (parameters or param-group dicts) with replaced experts' parameters swapped for the new ones."""
    if params is None:
        return None
    params = list(params)
    if params and isinstance(params[0], dict):
        return [{**g, "params": [_swap(p, replaced) for p in g["params"]]} for g in params]
    return [_swap(p, replaced) for p in params]


def remap_optimizer(optimizer, replaced):
    """Point a client optimizer built before ``initialize`` at the replaced experts' parameters."""
    if optimizer is None or not isinstance(optimizer, torch.optim.Optimizer):
        return
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            new = _swap(p, replaced)
            if new is not p:
                if optimizer.state.get(p):
                    raise ValueError("AutoEP: the client optimizer already holds state for an expert parameter; "
                                     "build it fresh before deepspeed.initialize")
                group["params"][i] = new


def configure_autoep(ds_config, model, mpu, world_size):
    """The engine's first AutoEP step, before any collective: the parsed section (None when disabled), checked.

    Raises on every rank for a bad section or model (module docstring).
    """
    cfg = getattr(ds_config, "expert_parallel_config", None) or AutoEPConfig.from_section(
        ds_config._param_dict.get("expert_parallel"))
    if not cfg.enabled:
        return None
    sp = ds_config._param_dict.get("sequence_parallel_size") or 1
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size"):
        sp = int(mpu.get_sequence_parallel_world_size())
    check_autoep(model, cfg, world_size, ds_config.zero_optimization_stage, sp)
    return cfg


def install_autoep(cfg, model, optimizer, model_parameters):
    """The engine's second AutoEP step, once the mesh exists: experts replaced and wired to their group.

    Returns ``model_parameters`` with the replaced parameters swapped (a client optimizer is
    remapped in place).
    """
    name = groups.expert_group_name(cfg.autoep_size)
    ep_rank = groups._get_expert_parallel_rank(name) if cfg.autoep_size > 1 else 0
    replaced = apply_autoep(model, cfg, ep_rank)
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.set_deepspeed_parallelism()
    remap_optimizer(optimizer, replaced)
    return remap_params(model_parameters, replaced)
