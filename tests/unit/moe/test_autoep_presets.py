# SPDX-License-Identifier: Apache-2.0
"""AutoEP presets for Qwen3.5-MoE, DeepSeek-V2 and DeepSeek-V3, and upstream's routing keys.

Routing: :func:`deepspeed.moe.autoep_router.route` with a preset's own spec equals the HF router of
that model (every family, random expert counts, top-k and groups, seeded); with routing keys set it
equals the HF router of the model whose config says the same (DeepSeek's ``routed_scaling_factor``,
``norm_topk_prob``, ``n_group``/``topk_group``, every family's top-k), and ``score_func`` /
``score_apply`` / ``route_scale`` values no HF config expresses equal a plain-torch formula.

Training: tiny models of each preset train with AutoEP at ep 1, 2 and 4 on ZeRO 0-3 (GAS 1 and 4,
fp32 and bf16, cells with the optimizer offloaded, ZeRO-3 at ep 2 among them, one with the parameters offloaded
too and the model built under ``deepspeed.zero.Init``); losses and gradients equal the
unsharded HF model's in plain torch, each rank's experts against the same slice of the unsharded experts. A
cell with routing keys compares with the HF model whose config routes that way.
"""

import copy
import math

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.moe.autoep_models import MODELS

T = 300
SEQ = 6

# routing keys -> the HF config that routes the same way
KEY_CELLS = {
    "deepseek_v3": ({
        "routed_scaling_factor": 1.0,
        "route_norm": False,
        "num_limited_groups": 3,
        "top_k": 3
    }, {
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "topk_group": 3,
        "num_experts_per_tok": 3
    }),
    "deepseek_v2": ({
        "routed_scaling_factor": 0.5,
        "num_expert_groups": 4,
        "num_limited_groups": 2,
    }, {
        "routed_scaling_factor": 0.5,
        "n_group": 4,
        "topk_group": 2
    }),
    "qwen3_moe": ({
        "route_norm": False,
        "top_k": 1
    }, {
        "norm_topk_prob": False,
        "num_experts_per_tok": 1
    }),
    "mixtral": ({
        "top_k": 3
    }, {
        "num_experts_per_tok": 3
    }),
    "qwen3_5_moe": ({
        "top_k": 1
    }, {
        "num_experts_per_tok": 1
    }),
}


def _routers(model):
    return [m for m in model.modules() if type(m).__name__.endswith(("TopkRouter", "TopKRouter"))]


def _same_routes(a, b, exact):
    """Two routers' ``(logits, weights, experts)`` agree (routes compared as sets per token)."""
    ia, oa = a[2].sort(-1)
    ib, ob = b[2].sort(-1)
    wa, wb = a[1].gather(1, oa), b[1].gather(1, ob)
    if exact:
        return torch.equal(a[0], b[0]) and torch.equal(ia, ib) and torch.equal(wa, wb)
    return torch.equal(ia, ib) and torch.allclose(wa, wb, rtol=1e-6, atol=1e-7)


def _cfg(**keys):
    from deepspeed.moe.autoep_config import AutoEPConfig
    return AutoEPConfig.from_section({"enabled": True, **keys})


@pytest.mark.parametrize("preset", sorted(MODELS))
def test_own_routing_is_the_models_router(preset):
    """The spec read from each HF config routes exactly as the HF router does, on random shapes."""
    from deepspeed.moe.autoep_presets import own_routing
    from deepspeed.moe.autoep_router import route
    g = torch.Generator().manual_seed(sum(map(ord, preset)))
    for _ in range(3):
        experts = int(torch.randint(2, 5, (1, ), generator=g)) * 2
        top_k = int(torch.randint(1, 4, (1, ), generator=g))
        extra = {}
        if preset.startswith("deepseek"):
            extra = {"n_group": 2, "topk_group": int(torch.randint(1, 3, (1, ), generator=g))}
        model = MODELS[preset](experts=experts, top_k=top_k, **extra)
        spec = own_routing(preset, model.config)
        for router in _routers(model):
            x = torch.randn(int(torch.randint(1, 9, (1, ), generator=g)), 16, generator=g)
            assert _same_routes(router(x), route(router, spec, x), exact=True), (preset, experts, top_k, extra)


@pytest.mark.parametrize("preset", sorted(KEY_CELLS))
def test_routing_keys_equal_the_hf_router_configured_so(preset):
    from deepspeed.moe.autoep_presets import own_routing, requested_routing
    from deepspeed.moe.autoep_router import route
    keys, hf = KEY_CELLS[preset]
    experts = 8
    model = MODELS[preset](experts=experts)
    other = MODELS[preset](experts=experts, **hf)
    own = own_routing(preset, model.config)
    spec = requested_routing(own, _cfg(**keys), model.config, experts)
    assert spec != own
    g = torch.Generator().manual_seed(1)
    for router, want in zip(_routers(model), _routers(other)):
        assert torch.equal(router.weight, want.weight)
        x = torch.randn(11, 16, generator=g)
        assert _same_routes(route(router, spec, x), want(x), exact=False), preset


def _formula(weight, x, score_func, top_k, norm, scale):
    """Plain torch: score every expert, keep the top-k, optionally normalise, scale."""
    logits = x @ weight.t()
    scores = logits.float().sigmoid() if score_func == "sigmoid" else logits.float().softmax(-1)
    top, idx = scores.topk(top_k, dim=-1)
    if norm:
        top = top / top.sum(-1, keepdim=True)
    return top * scale, idx


@pytest.mark.parametrize("preset, keys", [("mixtral", {
    "score_func": "sigmoid",
    "route_norm": False,
    "route_scale": 2.0
}), ("qwen3_5_moe", {
    "score_func": "sigmoid",
    "route_scale": 0.5,
    "top_k": 3
}), ("deepseek_v3", {
    "score_func": "softmax",
    "num_limited_groups": 4,
    "routed_scaling_factor": 0.25
})])
def test_score_func_and_scale_equal_the_formula(preset, keys):
    from deepspeed.moe.autoep_presets import own_routing, requested_routing
    from deepspeed.moe.autoep_router import route
    model = MODELS[preset](experts=8)
    spec = requested_routing(own_routing(preset, model.config), _cfg(**keys), model.config, 8)
    router = _routers(model)[0]
    if spec.correction_bias:
        router.e_score_correction_bias.zero_()  # the formula has no bias; all 4 groups kept: no group mask
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(2))
    _, weights, idx = route(router, spec, x)
    want_w, want_i = _formula(router.weight.detach(), x, spec.score_func, spec.top_k, spec.route_norm,
                              spec.route_scale)
    got = torch.zeros(9, 8).scatter(1, idx, weights)
    want = torch.zeros(9, 8).scatter(1, want_i, want_w)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)


def test_upstream_keys_parse_honoured_or_refused_by_name():
    """Every key of upstream's section parses at upstream's default; values upstream rejects raise ValueError,
    values this release cannot compute NotImplementedError, naming the key; an unknown key raises."""
    import inspect
    from deepspeed.moe.autoep_config import AutoEPConfig
    defaults = {f: v.default for f, v in inspect.signature(AutoEPConfig).parameters.items()}
    defaults.pop("expert_w3")  # absent means the preset's; null means fused
    cfg = AutoEPConfig.from_section({**defaults, "enabled": True, "preset_model": "deepseek_v3"})
    assert cfg.preset_model == "deepseek_v3"
    for key, value in [("combine_impl", "legacy_bmm"), ("combine_impl", "fused_weighted_sum"),
                       ("gate_up_impl", "fused"), ("async_split_plan", True), ("validate_folding_routing", True),
                       ("comm_num_sm", 24), ("expert_activation", "geglu_tanh"), ("score_apply", "pre"),
                       ("num_expert_groups", 2), ("expert_w3", None), ("moe_layer_pattern", r"model\.layers\.1\.mlp")]:
        AutoEPConfig.from_section({key: value})
    for key, value in [("load_balance_coeff", 0.01), ("score_func", "relu"), ("comm_num_sm", 0),
                       ("row_weighting_impl", "fused"), ("preset_model", "gpt_oss"), ("top_k", 0),
                       ("expert_w1", "a.b")]:
        with pytest.raises(ValueError, match=key):
            AutoEPConfig.from_section({key: value})
    for key, value in [("comm_backend", "deepep"), ("expert_tensor_parallel_size", 2),
                       ("expert_activation", "swiglu_oai"), ("expert_w3", "up_proj")]:
        section = {key: value, "comm_max_tokens_per_rank": 64} if value == "deepep" else {key: value}
        with pytest.raises(NotImplementedError, match=key):
            AutoEPConfig.from_section(section)
    with pytest.raises(ValueError, match="unknown config key 'expert_parallel.autoep_sise'"):
        AutoEPConfig.from_section({"autoep_sise": 2})


def test_block_keys_and_custom_presets_refused_by_name():
    """Keys naming children other than the preset block's own, and a custom preset (moe_layer_pattern on a model no
    preset serves), raise naming the key before anything is replaced; a pattern selecting blocks is honoured."""
    from deepspeed.moe.autoep import block_plan, check_autoep
    model = MODELS["deepseek_v3"]()
    with pytest.raises(NotImplementedError, match="shared_experts_pattern"):
        check_autoep(model, _cfg(shared_experts_pattern="shared_expert"), 2, 2)
    with pytest.raises(NotImplementedError, match="has_shared_experts"):
        check_autoep(model, _cfg(has_shared_experts=False), 2, 2)
    check_autoep(model, _cfg(router_pattern="gate", expert_w1="gate_up_proj", has_shared_experts=True), 2, 2)
    picked = block_plan(model, _cfg(moe_layer_pattern=r"model\.layers\.2\.mlp"), "deepseek_v3")
    assert [name for name, _, _ in picked] == ["model.layers.2.mlp"]
    with pytest.raises(ValueError, match="moe_layer_pattern"):
        block_plan(model, _cfg(moe_layer_pattern=r"model\.layers\.0\.mlp"), "deepseek_v3")  # the dense layer
    model.config.model_type = "my_moe"
    with pytest.raises(NotImplementedError, match="moe_layer_pattern"):
        check_autoep(model, _cfg(moe_layer_pattern=r"model\.layers\.\d+\.mlp"), 2, 2)


# ------------------------------------------------------------------------------------------------ training


def _batches(world, gas):
    g = torch.Generator().manual_seed(11)
    return [[torch.randint(0, 32, (1, SEQ), generator=g) for _ in range(world)] for _ in range(gas)]


def _is_routed_expert(name):
    return name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj")


def _run(cell):
    """One training cell; returns the mismatches (empty when losses and gradients agree)."""
    import deepspeed
    from deepspeed.utils import groups, safe_get_full_grad
    preset, stage, ep, gas, dtype, offload, keys = cell[:7]
    shape = cell[7] if len(cell) > 7 else {}  # the model's expert count and top-k
    zero_init = cell[8] if len(cell) > 8 else False  # the model built under deepspeed.zero.Init
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    key_set, hf_overrides = KEY_CELLS[preset] if keys else ({}, {})
    with deepspeed.zero.Init(enabled=zero_init):
        model = MODELS[preset](**shape)
    assert zero_init == all(hasattr(p, "ds_id") for p in model.parameters())
    if zero_init:  # the values of the model built as usual (HF's weight init is not zero.Init-aware)
        plain = MODELS[preset](**shape)
        with torch.no_grad(), deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            for p, q in zip(model.parameters(), plain.parameters()):
                p.copy_(q)
    reference = MODELS[preset](**shape, **hf_overrides)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 700
        },
        "optimizer": {
            "type": "Adam" if offload else "SGD",
            "params": {
                "lr": 0.0
            }
        },
        "expert_parallel": {
            "enabled": True,
            "autoep_size": ep,
            **key_set
        }
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
        reference = reference.to(torch.bfloat16)
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if offload == "param":  # the 16-bit shards on the host too
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    assert (getattr(engine._stage, "fetch", None) is not None) == (offload == "param")
    batches = _batches(world, gas)
    losses, got = [], {}
    for micro in range(gas):
        ids = batches[micro][rank]
        loss = engine(input_ids=ids, labels=ids).loss
        losses.append(float(loss))
        engine.backward(loss)
        if micro == gas - 1:
            got = {name: safe_get_full_grad(p).float() for name, p in model.named_parameters()}
        engine.step()
    experts = next(m for m in model.modules() if type(m).__name__ == "GroupedExperts")
    first, local = experts.first_expert, experts.num_local_experts
    engine.destroy()
    groups.reset_mesh()
    ref_grads = {n: torch.zeros(p.shape) for n, p in reference.named_parameters()}
    ref_losses = []
    for micro in range(gas):
        for r in range(world):
            reference.zero_grad()
            ids = batches[micro][r]
            loss = reference(input_ids=ids, labels=ids).loss
            loss.backward()
            if r == rank:
                ref_losses.append(float(loss))
            for n, p in reference.named_parameters():
                if p.grad is not None:
                    ref_grads[n] += p.grad.float() / (world * gas)
    tol = 1e-5 if dtype == "fp32" else 2e-2
    bad = [f"loss {i}: {a} vs {b}" for i, (a, b) in enumerate(zip(losses, ref_losses)) if abs(a - b) > tol * abs(b)]
    total = float(torch.cat([g.reshape(-1) for g in ref_grads.values()]).norm())
    for n, g in got.items():
        want = ref_grads[n][first:first + local] if _is_routed_expert(n) else ref_grads[n]
        err = float((g - want).norm())
        if not err <= tol * max(float(want.norm()), 0.05 * total):
            bad.append(f"{n}: |diff| {err:.3g} |ref| {float(want.norm()):.3g}")
    return bad


def _run_cells(cells):
    out = []
    for cell in cells:
        bad = _run(cell)
        if bad:
            out.append((cell, bad[:3]))
    return out


# (preset, stage, ep, gas, dtype, offload, routing keys): every preset, stages 0-3, ep 1/2/4, GAS 1/4, fp32 and
# bf16, the optimizer offloaded, routing keys (the auxiliary loss of Mixtral, Qwen3 and Qwen3.5 included)
CELLS_2 = [("qwen3_moe", 2, 1, 1, "fp32", False, False), ("deepseek_v3", 2, 2, 4, "fp32", False, False),
           ("deepseek_v3", 3, 1, 4, "fp32", False, False), ("qwen3_5_moe", 3, 1, 1, "bf16", True, False),
           ("qwen3_5_moe", 1, 2, 1, "bf16", True, False), ("deepseek_v2", 0, 1, 1, "fp32", False, True),
           ("deepseek_v3", 1, 2, 1, "fp32", False, True), ("deepseek_v3", 3, 2, 4, "fp32", False, True)]
# ZeRO-3 at ep 2 on world 4: the experts sharded over their expert-data-parallel group of two ranks (bf16 with the
# optimizer offloaded: the pipelined unit step; fp32 with the optimizer and the parameters offloaded, "param", and the
# model built under zero.Init, its fused experts sliced from their whole value)
CELLS_4 = [("mixtral", 1, 4, 1, "fp32", False, False), ("deepseek_v2", 2, 4, 1, "fp32", False, False),
           ("qwen3_5_moe", 3, 2, 1, "bf16", True, False)]


def _random_shape(seed):
    """A seeded random expert count (even: ep 2 divides it) and top-k for a model without expert groups."""
    g = torch.Generator().manual_seed(seed)
    experts = 2 * int(torch.randint(1, 5, (1, ), generator=g))
    return {"experts": experts, "top_k": int(torch.randint(1, min(experts, 4) + 1, (1, ), generator=g))}


CELLS_2.append(("qwen3_5_moe", 2, 2, 1, "fp32", False, False, _random_shape(40)))  # 6 experts (3 per rank), top-4
CELLS_4.append(("mixtral", 3, 2, 1, "fp32", False, False, _random_shape(45)))  # ZeRO-3: 8 experts (4 per rank), top-3
CELLS_4.append(("mixtral", 3, 2, 2, "fp32", "param", False, _random_shape(49), True))  # 6 experts, top-2; zero.Init


def test_presets_world2():
    assert run_distributed(_run_cells, 2, args=(CELLS_2, ), timeout=T) == [[], []]


def test_presets_world4():
    assert run_distributed(_run_cells, 4, args=(CELLS_4, ), timeout=T) == [[]] * 4


def test_score_apply_pre_matches_weighting_inputs():
    """score_apply 'pre' weighs each expert's input instead of its output: against a plain loop."""
    import torch.nn.functional as F
    from deepspeed.moe.autoep import GroupedExperts
    model = MODELS["mixtral"](experts=4)
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.5)
        experts.down_proj.normal_(0, 0.5)
    grouped = GroupedExperts(copy.deepcopy(experts), ep_size=1, ep_rank=0, score_apply="pre")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)])
    w = torch.rand(5, 2, generator=g)
    want = torch.zeros(5, 16)
    with torch.no_grad():
        for t in range(5):
            for j in range(2):
                e = int(idx[t, j])
                gate, up = F.linear(x[t] * w[t, j], experts.gate_up_proj[e]).chunk(2)
                want[t] += F.linear(F.silu(gate) * up, experts.down_proj[e])
        assert torch.allclose(grouped(x, idx, w), want, rtol=1e-5, atol=1e-6)
        assert not math.isclose(float(want.norm()), float(experts(x, idx, w).norm()), rel_tol=1e-3)


def _non_finite_on_one_rank(stage, offload):
    """An infinite gradient in rank 1's local experts only: every rank skips the step (parameters unchanged); the
    next window steps on every rank."""
    import deepspeed
    from deepspeed.utils import groups, safe_get_full_fp32_param
    rank = torch.distributed.get_rank()
    model = MODELS["deepseek_v3"]()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {
            "enabled": True
        },
        "zero_optimization": {
            "stage": stage
        },
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 0.01
            }
        },
        "expert_parallel": {
            "enabled": True,
            "autoep_size": 2
        }
    }
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    experts = next(m for m in model.modules() if type(m).__name__ == "GroupedExperts")
    before = {n: safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
    handle = experts.down_proj.register_hook(lambda g: g * float("inf")) if rank == 1 else None
    ids = torch.arange(SEQ).unsqueeze(0) + rank
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    skipped = (not engine.was_step_applied(), engine.skipped_steps)
    same = all(torch.equal(safe_get_full_fp32_param(p), before[n]) for n, p in model.named_parameters())
    if handle is not None:
        handle.remove()
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    applied = engine.was_step_applied()
    moved = not torch.equal(safe_get_full_fp32_param(experts.down_proj),
                            before["model.layers.1.mlp.experts.down_proj"])
    engine.destroy()
    groups.reset_mesh()
    return skipped, same, applied, moved


@pytest.mark.parametrize("stage, offload", [(2, False), (1, True), (3, False)])
def test_non_finite_expert_gradient_on_one_rank_skips_everywhere(stage, offload):
    results = run_distributed(_non_finite_on_one_rank, 2, args=(stage, offload), timeout=T)
    assert results == [((True, 1), True, True, True)] * 2, results
