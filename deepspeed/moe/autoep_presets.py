# SPDX-License-Identifier: Apache-2.0
"""AutoEP presets: which Hugging Face sparse blocks AutoEP shards, and how each one routes its tokens.

A preset names the HF ``model_type`` values it serves, the class of the model's sparse MoE block
and the attributes that hold its number of experts and its top-k. Every block holds its router in
``gate``, its fused experts (``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``) in ``experts``,
and its shared experts (if any) under the names listed; the block's own ``forward`` combines them.

:func:`own_routing` states the model's own router as a :class:`RoutingSpec`;
:func:`requested_routing` applies the config's routing keys to it (upstream's precedence). Where
the two are equal the model's router runs untouched; otherwise ``autoep_router`` routes as asked.
Imports: nothing from the runtime.
"""

import math
from dataclasses import dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class Preset:
    model_types: tuple
    block: str
    num_experts_attr: str
    top_k_attr: str = "num_experts_per_tok"
    shared_experts: str = ""
    shared_experts_gate: str = ""
    unsupported_model_types: tuple = ()  # (model_type, why) pairs refused by name


PRESETS = {
    "mixtral":
    Preset(("mixtral", ), "MixtralSparseMoeBlock", "num_local_experts"),
    "qwen3_moe":
    Preset(("qwen3_moe", ), "Qwen3MoeSparseMoeBlock", "num_experts"),
    "qwen3_5_moe":
    Preset(("qwen3_5_moe_text", ),
           "Qwen3_5MoeSparseMoeBlock",
           "num_experts",
           shared_experts="shared_expert",
           shared_experts_gate="shared_expert_gate",
           unsupported_model_types=(("qwen3_5_moe", "pass the text backbone (model_type "
                                     "'qwen3_5_moe_text', Qwen3_5MoeForCausalLM), as upstream"), )),
    "deepseek_v2":
    Preset(("deepseek_v2", ), "DeepseekV2Moe", "n_routed_experts", shared_experts="shared_experts"),
    "deepseek_v3":
    Preset(("deepseek_v3", ), "DeepseekV3MoE", "n_routed_experts", shared_experts="shared_experts"),
}


@dataclass(frozen=True)
class RoutingSpec:
    """How one block turns router logits into ``(weights [T, k], experts [T, k])``.

    scores = score_func(logits); the choice is made on scores (+ the router's
    ``e_score_correction_bias`` with ``correction_bias``), restricted to the ``num_limited_groups``
    best of ``num_expert_groups`` equal groups (group score: its best score, ``max``, or the sum of
    its best two, ``top2_sum``; other groups' scores become ``masked_score``); the weights are the
    chosen experts' scores, divided by their sum with ``route_norm``, times ``route_scale``.
    ``score_apply``: ``post`` weighs each expert's output, ``pre`` its input.
    ``logits_fp32``: logits computed in float32 (else in the input's dtype, scored in float32);
    ``weights_fp32``: weights returned in float32 (else in the logits' dtype).
    """
    top_k: int
    score_func: str = "softmax"
    route_norm: bool = True
    route_scale: float = 1.0
    num_expert_groups: Optional[int] = None
    num_limited_groups: Optional[int] = None
    group_score_func: str = "top2_sum"
    masked_score: float = -math.inf
    correction_bias: bool = False
    score_apply: str = "post"
    logits_fp32: bool = False
    weights_fp32: bool = True


def own_routing(preset, model_config):
    """The model's own router of ``preset`` as a :class:`RoutingSpec` (read from the HF modeling code)."""
    top_k = int(getattr(model_config, PRESETS[preset].top_k_attr))
    if preset == "mixtral":
        return RoutingSpec(top_k)
    if preset == "qwen3_moe":
        return RoutingSpec(top_k, route_norm=bool(model_config.norm_topk_prob), weights_fp32=False)
    if preset == "qwen3_5_moe":
        return RoutingSpec(top_k, weights_fp32=False)
    scale = float(model_config.routed_scaling_factor)
    if preset == "deepseek_v2":
        grouped = getattr(model_config, "topk_method", "greedy") == "group_limited_greedy"
        return RoutingSpec(top_k,
                           route_norm=False,
                           route_scale=scale,
                           num_expert_groups=model_config.n_group if grouped else None,
                           num_limited_groups=model_config.topk_group if grouped else None,
                           group_score_func="max",
                           masked_score=0.0,
                           logits_fp32=True)
    if preset == "deepseek_v3":
        return RoutingSpec(top_k,
                           score_func="sigmoid",
                           route_norm=bool(model_config.norm_topk_prob),
                           route_scale=scale,
                           num_expert_groups=model_config.n_group,
                           num_limited_groups=model_config.topk_group,
                           correction_bias=True,
                           logits_fp32=True)
    raise KeyError(preset)


def requested_routing(own, cfg, model_config, num_experts):
    """``own`` with the config's routing keys applied (upstream's precedence); ValueError for a bad result.

    ``top_k`` (an int) wins over ``top_k_attr``; ``routed_scaling_factor`` (a number) wins over the
    model config's ``routed_scaling_factor``, which wins over ``route_scale``; ``auto`` / null keep
    the model's own.
    """
    top_k = own.top_k
    if isinstance(cfg.top_k, int):
        top_k = cfg.top_k
    elif cfg.top_k_attr is not None:
        if not hasattr(model_config, cfg.top_k_attr):
            raise ValueError(f"expert_parallel.top_k_attr={cfg.top_k_attr!r}: the model config has no such attribute")
        top_k = int(getattr(model_config, cfg.top_k_attr))
    if cfg.routed_scaling_factor != "auto":
        scale = float(cfg.routed_scaling_factor)
    elif getattr(model_config, "routed_scaling_factor", None) is not None:
        scale = float(model_config.routed_scaling_factor)
    else:
        scale = float(cfg.route_scale)
    groups = cfg.num_expert_groups if cfg.num_expert_groups is not None else own.num_expert_groups
    limited = cfg.num_limited_groups if cfg.num_limited_groups is not None else own.num_limited_groups
    spec = replace(own,
                   top_k=top_k,
                   score_func=own.score_func if cfg.score_func == "auto" else cfg.score_func,
                   route_norm=own.route_norm if cfg.route_norm is None else cfg.route_norm,
                   route_scale=scale,
                   num_expert_groups=groups,
                   num_limited_groups=limited if groups is not None else None,
                   group_score_func=own.group_score_func if own.num_expert_groups is not None else "top2_sum",
                   masked_score=own.masked_score if own.num_expert_groups is not None else -math.inf,
                   score_apply=own.score_apply if cfg.score_apply == "auto" else cfg.score_apply)
    if not 1 <= spec.top_k <= num_experts:
        raise ValueError(f"expert_parallel: top_k={spec.top_k} must be between 1 and the number of experts "
                         f"({num_experts})")
    if limited is not None and groups is None:
        raise ValueError("expert_parallel.num_limited_groups needs num_expert_groups (the model has no groups)")
    if groups is not None:
        if limited is None:
            raise ValueError("expert_parallel.num_expert_groups needs num_limited_groups")
        if num_experts % groups != 0:
            raise ValueError(f"expert_parallel.num_expert_groups={groups} must divide the number of experts "
                             f"({num_experts})")
        if limited > groups:
            raise ValueError(f"expert_parallel.num_limited_groups={limited} must be <= num_expert_groups={groups}")
        if spec.group_score_func == "top2_sum" and num_experts // groups < 2:
            raise ValueError(f"expert_parallel.num_expert_groups={groups}: grouped routing scores a group by its "
                             f"best two experts, so each group needs at least 2 ({num_experts // groups})")
    return spec


def check_block_keys(cfg, preset):
    """The keys naming a block's children and weights: honoured where they name what ``preset``'s block holds."""
    p = PRESETS[preset]
    expected = {
        "router_pattern": "gate",
        "expert_pattern": "experts",
        "expert_w1": "gate_up_proj",
        "expert_w2": "down_proj",
        "has_shared_experts": bool(p.shared_experts),
        "shared_experts_pattern": p.shared_experts,
        "shared_experts_gate_pattern": p.shared_experts_gate,
    }
    for key, want in expected.items():
        value = getattr(cfg, key)
        if value is not None and value != want:
            raise NotImplementedError(f"config key 'expert_parallel.{key}'={value!r} is not supported with preset "
                                      f"'{preset}': its block holds {want!r} and runs its own forward over it; see "
                                      f"docs/moe.md")
