# SPDX-License-Identifier: Apache-2.0
"""What AutoEP's ``GroupedExperts`` saves for backward, and that its values and gradients are plain torch's.

The combine (each token's routes summed into its row) keeps only the route-to-token index for backward:
autograd's own ``index_add`` would also keep the weighted route rows, a ``[tokens * top_k, hidden]`` tensor
per MoE layer, for their shape alone. Checked on seeded random shapes (one expert, top-1, 1-wide layers
included), fp32 and bf16, with router weights in the hidden dtype (Qwen) and in fp32 (DeepSeek-V3's router).
"""

import types

import pytest
import torch
import torch.nn.functional as F

from deepspeed.moe.autoep import GroupedExperts


def _experts(E, H, Fw, dtype, g):
    return types.SimpleNamespace(num_experts=E,
                                 hidden_dim=H,
                                 intermediate_dim=Fw,
                                 act_fn=F.silu,
                                 gate_up_proj=torch.nn.Parameter(
                                     (torch.randn(E, 2 * Fw, H, generator=g) / H**0.5).to(dtype)),
                                 down_proj=torch.nn.Parameter(
                                     (torch.randn(E, H, Fw, generator=g) / Fw**0.5).to(dtype)))


def _reference(x, index, weights, gate_up, down):
    """Every route on its own, summed per token (the same maths, no sorting, no grouping)."""
    out = torch.zeros_like(x)
    T, k = index.shape
    for t in range(T):
        acc = torch.zeros_like(x[t])
        for j in range(k):
            e = int(index[t, j])
            gate, up = F.linear(x[t], gate_up[e]).chunk(2, dim=-1)
            acc = acc + (F.linear(F.silu(gate) * up, down[e]) * weights[t, j]).to(x.dtype)
        out = torch.cat([out[:t], acc[None], out[t + 1:]])
    return out


def _saved_bytes(fn, exclude):
    """Bytes of the distinct storages ``fn``'s autograd graph saves, parameters (``exclude``) left out."""
    seen = {}
    skip = {t.untyped_storage().data_ptr() for t in exclude}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _shape(seed):
    g = torch.Generator().manual_seed(seed)
    E = int(torch.randint(1, 6, (1, ), generator=g))
    k = int(torch.randint(1, E + 1, (1, ), generator=g))
    T, H, Fw = (int(torch.randint(1, 9, (1, ), generator=g)) for _ in range(3))
    return g, E, k, T, H, Fw


@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_grouped_experts_saves_no_route_rows_and_equals_plain_torch(dtype, weight_dtype, seed):
    g, E, k, T, H, Fw = _shape(seed)
    experts = _experts(E, H, Fw, dtype, g)
    layer = GroupedExperts(experts, ep_size=1, ep_rank=0, use_grouped_mm=False)
    x = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    scores = torch.rand(T, E, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = scores.gather(1, index).to(weight_dtype).requires_grad_()
    params = [layer.gate_up_proj, layer.down_proj]

    out, saved = _saved_bytes(lambda: layer(x, index, weights), params)
    # rows, each expert's gate_up / act / act * up, the expert outputs and the router weights they are scaled by,
    # and two route indices (sorted order, token of each route): nothing of the size of the weighted rows
    N, size = T * k, torch.empty(0, dtype=dtype).element_size()
    want = N * (H + 4 * Fw + H) * size + N * weights.element_size() + 2 * N * 8
    assert saved == want, (saved, want)

    grad = torch.randn(T, H, generator=g).to(dtype)
    got = torch.autograd.grad(out, [x, weights, *params], grad)
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    x2, w2 = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    ref = _reference(x2, index, w2, *ref_params)
    want_grads = torch.autograd.grad(ref, [x2, w2, *ref_params], grad)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(got, want_grads):
        torch.testing.assert_close(a, b, **tol)
