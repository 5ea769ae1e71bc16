# SPDX-License-Identifier: Apache-2.0
"""Gating against the token-by-token reference (tests/unit/moe/reference.py): routes, capacity, dropping,
weights, the aux loss, the counts; the layer's output at ep 1 against every expert run on its tokens."""

import random

import pytest
import torch

from deepspeed.moe.layer import MoE
from deepspeed.moe.sharded_moe import top1gating, top2gating, topkgating
from tests.unit.moe.reference import capacity, dense_combine, reference_moe_output, reference_routes

CASES = [(S, E, k, cf, mc) for S, E, k, cf, mc in [
    (1, 2, 1, 1.0, 0),
    (5, 2, 1, 1.0, 4),
    (17, 4, 1, 0.5, 1),
    (17, 4, 2, 0.5, 1),
    (33, 8, 2, 1.0, 2),
    (16, 8, 3, 1.0, 0),
    (40, 8, 4, 0.25, 1),
    (3, 8, 8, 2.0, 1),
    (64, 64, 8, 1.0, 4),
    (7, 3, 2, 4.0, 0),
]]


def _gating(logits, k, cf, mc):
    if k == 1:
        return top1gating(logits, cf, mc, use_rts=False)
    if k == 2:
        return top2gating(logits, cf, mc, top2_2nd_expert_sampling=False)
    return topkgating(logits, k, cf, mc)


@pytest.mark.parametrize("S, E, k, cf, mc", CASES)
def test_gating_matches_reference(S, E, k, cf, mc):
    torch.manual_seed(S * 131 + E * 7 + k)
    logits = torch.randn(S, E) * 2
    l_aux, combine, dispatch, counts = _gating(logits, k, cf, mc)
    routes, C, ref_aux, ref_counts = reference_routes(logits, k, cf, mc)
    assert combine.shape == (S, E, C) and C <= max(S, 1)
    torch.testing.assert_close(combine, dense_combine(routes, S, E, C), rtol=1e-6, atol=1e-7)
    assert torch.equal(dispatch, dense_combine(routes, S, E, C) > 0)
    assert counts.tolist() == ref_counts
    assert abs(float(l_aux) - ref_aux) < 1e-5 * max(1.0, abs(ref_aux))
    # capacity: no expert over C, and the dropped ones are exactly those the reference drops
    assert int(dispatch.sum(dim=(0, 2)).max()) <= C


def test_capacity_never_above_token_count():
    for S in (1, 2, 3, 10):
        logits = torch.randn(S, 4)
        for k, fn in ((1, lambda: top1gating(logits, 8.0, 16, use_rts=False)),
                      (2, lambda: top2gating(logits, 8.0, 16, top2_2nd_expert_sampling=False)),
                      (3, lambda: topkgating(logits, 3, 8.0, 16))):
            _, combine, _, _ = fn()
            assert combine.shape[2] == min(S, capacity(S, 4, k, 8.0, 16)) == S


def test_no_drop_keeps_every_route():
    logits = torch.randn(50, 4) * 3
    for k in (1, 2, 3):
        if k == 1:
            _, combine, dispatch, counts = top1gating(logits, 0.1, 1, drop_tokens=False, use_rts=False)
        elif k == 2:
            _, combine, dispatch, counts = top2gating(logits,
                                                      0.1,
                                                      1,
                                                      drop_tokens=False,
                                                      top2_2nd_expert_sampling=False)
        else:
            _, combine, dispatch, counts = topkgating(logits, 3, 0.1, 1, drop_tokens=False)
        assert combine.shape[2] == int(counts.max())
        assert int(dispatch.sum()) == 50 * k
        gates = torch.softmax(logits, 1)
        expected = torch.ones(50) if k > 1 else gates.max(1).values
        torch.testing.assert_close(combine.sum(dim=(1, 2)), expected)


def test_random_token_selection_keeps_capacity_tokens_per_expert():
    torch.manual_seed(0)
    logits = torch.randn(40, 4)
    gates = torch.softmax(logits, 1)
    _, combine, dispatch, counts = top1gating(logits, 0.5, 1, use_rts=True)
    C = combine.shape[2]
    per_expert = dispatch.sum(dim=(0, 2))
    assert per_expert.tolist() == [min(int(c), C) for c in counts]
    kept_tokens = dispatch.any(dim=2).any(dim=1)
    chosen = gates.argmax(1)
    torch.testing.assert_close(combine.sum(dim=(1, 2))[kept_tokens], gates[kept_tokens, chosen[kept_tokens]])


def test_routes_use_int64_at_64_experts():
    from deepspeed.moe.sharded_moe import route_topk
    r = route_topk(torch.randn(4096, 64), 8, 1.0, 4)
    assert r.locations.dtype == torch.int64 and r.experts.dtype == torch.int64
    _, slots, _ = r.slots()
    assert slots.dtype == torch.int64 and int(slots.max()) < 64 * r.capacity


class _Expert(torch.nn.Module):

    def __init__(self, d, h):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, h)
        self.fc2 = torch.nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("seed", range(4))
def test_layer_matches_reference(seed):
    rng = random.Random(seed)
    d, E = rng.choice([1, 3, 8]), rng.choice([2, 4, 6])
    k = rng.choice([1, 2, min(3, E)])
    cf, mc = rng.choice([0.5, 1.0, 2.0]), rng.choice([0, 1, 3])
    torch.manual_seed(seed)
    layer = MoE(d,
                _Expert(d, 5),
                num_experts=E,
                k=k,
                capacity_factor=cf,
                eval_capacity_factor=cf,
                min_capacity=mc,
                use_rts=False,
                top2_2nd_expert_sampling=False)
    for expert in layer.deepspeed_moe.experts.deepspeed_experts:  # distinct experts
        for p in expert.parameters():
            torch.nn.init.normal_(p)
    x = torch.randn(2, rng.choice([1, 7, 12]), d, requires_grad=True)
    out, l_aux, counts = layer(x)
    experts = list(layer.deepspeed_moe.experts.deepspeed_experts)
    ref, ref_aux, _ = reference_moe_output(x.reshape(-1, d), layer.deepspeed_moe.gate.wg.weight, experts, k, cf, mc)
    torch.testing.assert_close(out.reshape(-1, d), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l_aux, ref_aux, rtol=1e-5, atol=1e-6)
    params = [x, layer.deepspeed_moe.gate.wg.weight] + [p for e in experts for p in e.parameters()]
    got = torch.autograd.grad((out.square().sum() + l_aux), params, allow_unused=True)
    want = torch.autograd.grad((ref.square().sum() + ref_aux), params, allow_unused=True)
    for g, w in zip(got, want):
        if w is None:
            assert g is None or float(g.abs().max()) == 0
        else:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_bad_expert_counts():
    with pytest.raises(ValueError, match="divisible by ep_size"):
        MoE(4, torch.nn.Linear(4, 4), num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="k=5"):
        MoE(4, torch.nn.Linear(4, 4), num_experts=4, k=5)


@pytest.mark.parametrize("S, E, k, cf, mc", CASES[:8])
def test_sparse_routes_and_dispatch_helpers_match_the_reference(S, E, k, cf, mc):
    """``sparse_routes=True`` returns the reference routes as ``[k, S]`` tensors (-1 for a dropped route), and
    ``_route_slots`` / ``_sparse_encode`` / ``_sparse_decode`` dispatch and combine exactly as the dense tensors."""
    from deepspeed.moe.sharded_moe import _route_slots, _sparse_decode, _sparse_encode
    torch.manual_seed(S * 131 + E * 7 + k)
    logits = torch.randn(S, E) * 2
    routes, C, _, _ = reference_routes(logits, k, cf, mc)
    if k == 1:
        sparse = top1gating(logits, cf, mc, use_rts=False, sparse_routes=True)
    elif k == 2:
        sparse = top2gating(logits, cf, mc, top2_2nd_expert_sampling=False, sparse_routes=True)
    else:
        sparse = topkgating(logits, k, cf, mc, sparse_routes=True)
    _, capacity_, experts_, indices, locations, gates, _ = sparse
    assert (int(capacity_), experts_, indices.shape, indices.dtype) == (C, E, (k, S), torch.int32)
    for s in range(S):
        kept = sorted(
            (int(indices[j, s]), int(locations[j, s]), float(gates[j, s])) for j in range(k) if indices[j, s] >= 0)
        assert [(e, loc) for e, loc, _ in kept] == sorted((e, loc) for e, loc, _ in routes[s])
        assert all(abs(w - dict(((e, loc), w) for e, loc, w in routes[s])[(e, loc)]) < 1e-6 for e, loc, w in kept)
    assert all(float(gates[j, s]) == 0.0 for j in range(k) for s in range(S) if indices[j, s] < 0)
    hidden = torch.randn(S, 5, dtype=torch.float64)
    combine = dense_combine(routes, S, E, C).double()
    slots = _route_slots(indices, locations, E, C)
    torch.testing.assert_close(_sparse_encode(hidden, slots, E, C),
                               torch.einsum("sec,sm->ecm", (combine > 0).double(), hidden))
    expert_out = torch.randn(E, C, 5, dtype=torch.float64)
    torch.testing.assert_close(_sparse_decode(expert_out.view(E * C, 5), slots, gates.double(), S),
                               torch.einsum("sec,ecm->sm", combine, expert_out))
