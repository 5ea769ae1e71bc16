# SPDX-License-Identifier: Apache-2.0
"""DistributedAttention and the all-to-all: the sharded attention equals full attention, outputs and gradients."""

import pytest
import torch
import torch.nn.functional as F

from tests.unit.common import run_distributed


def _causal_attention(q, k, v):
    # [s, b, h, d] -> sdpa's [b, h, s, d] and back
    out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3),
                                         k.permute(1, 2, 0, 3),
                                         v.permute(1, 2, 0, 3),
                                         is_causal=True,
                                         enable_gqa=True)
    return out.permute(2, 0, 1, 3)


def _sp_group(sp):
    """This rank's sequence-parallel group of contiguous ranks (the runtime's come from the mesh)."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mine = None
    for start in range(0, world, sp):
        group = torch.distributed.new_group(list(range(start, start + sp)))
        if start <= rank < start + sp:
            mine = group
    return mine, rank % sp


def _attention_matches(sp, seq, batch, heads, kv_heads, head_dim, dtype_name):
    from deepspeed.sequence.layer import DistributedAttention
    dtype = getattr(torch, dtype_name)
    group, sp_rank = _sp_group(sp)
    # Every rank of a group draws the same full tensors (seeded by the group index), then keeps its shard.
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank() // sp)
    q = torch.randn(seq, batch, heads, head_dim, generator=gen, dtype=dtype)
    k = torch.randn(seq, batch, kv_heads, head_dim, generator=gen, dtype=dtype)
    v = torch.randn(seq, batch, kv_heads, head_dim, generator=gen, dtype=dtype)
    w = torch.randn(seq, batch, heads, head_dim, generator=gen, dtype=dtype)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _causal_attention(*full)
    (ref * w).sum().backward()

    chunk = seq // sp
    sl = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    local = [t[sl].clone().requires_grad_() for t in (q, k, v)]
    attention = DistributedAttention(_causal_attention, group, scatter_idx=2, gather_idx=0)
    out = attention(*local, batch_dim_idx=1)
    (out * w[sl]).sum().backward()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, ref[sl], **tol)
    for mine, theirs in zip(local, full):
        torch.testing.assert_close(mine.grad, theirs.grad[sl], **tol)


@pytest.mark.parametrize("world,sp,seq,batch,heads,kv_heads,head_dim,dtype", [
    (2, 2, 8, 1, 2, 2, 4, "float32"),
    (2, 2, 6, 3, 4, 2, 3, "float32"),
    (4, 2, 10, 2, 2, 2, 5, "bfloat16"),
    (4, 4, 12, 1, 4, 4, 1, "float32"),
])
def test_distributed_attention_equals_full_attention(world, sp, seq, batch, heads, kv_heads, head_dim, dtype):
    run_distributed(_attention_matches, world, args=(sp, seq, batch, heads, kv_heads, head_dim, dtype))


def _all_to_all_round_trip():
    from deepspeed.sequence.layer import single_all_to_all
    rank = torch.distributed.get_rank()
    x = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3) + 100 * rank
    y = single_all_to_all(x, scatter_idx=1, gather_idx=0, batch_dim_idx=2, group=None)
    assert y.shape == (4, 2, 3)
    # rows [2r, 2r+2) of the gathered dim come from rank r; this rank received head chunk `rank`
    for source in range(2):
        expected = torch.arange(24, dtype=torch.float32).reshape(2, 4, 3)[:, 2 * rank:2 * rank + 2] + 100 * source
        torch.testing.assert_close(y[2 * source:2 * source + 2], expected)
    back = single_all_to_all(y, scatter_idx=0, gather_idx=1, batch_dim_idx=2, group=None)
    torch.testing.assert_close(back, x)


def _heads_not_divisible():
    from deepspeed.sequence.layer import DistributedAttention
    attention = DistributedAttention(_causal_attention, None)
    q = torch.randn(4, 1, 3, 2)
    with pytest.raises(ValueError, match="head count"):
        attention(q, q, q, batch_dim_idx=1)


def test_all_to_all_layout_and_round_trip():
    run_distributed(_all_to_all_round_trip, 2)


def test_heads_not_divisible_is_a_clear_error():
    run_distributed(_heads_not_divisible, 2)
