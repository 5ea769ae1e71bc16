# SPDX-License-Identifier: Apache-2.0
"""UlyssesSPDataLoaderAdapter: the shards of a group tile each sample exactly once, shift_labels cross the shard
borders, variable lengths are padded to the group size, and the group's token-weighted loss."""

import pytest
import torch

from tests.unit.common import run_distributed


def _sp_group(sp):
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mine = None
    for start in range(0, world, sp):
        group = torch.distributed.new_group(list(range(start, start + sp)))
        if start <= rank < start + sp:
            mine = group
    return mine, rank % sp


def _sample(seed, batch, seq):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (batch, seq), generator=gen)
    labels = ids.clone()
    labels[:, 0] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(seq).repeat(batch, 1), "tag": seed}


def _loader(rank, lengths, batch):
    # This rank's own samples: seeds 1000 * rank + i, lengths varying by batch and by rank.
    return [_sample(1000 * rank + i, batch, lengths[(i + rank) % len(lengths)]) for i in range(3)]


def _adapter_tiles(sp, lengths, batch):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    group, sp_rank = _sp_group(sp)
    rank = torch.distributed.get_rank()
    group_start = rank - sp_rank
    adapter = UlyssesSPDataLoaderAdapter(_loader(rank, lengths, batch),
                                         sp_rank=sp_rank,
                                         sp_group=group,
                                         sp_world_size=sp,
                                         device=torch.device("cpu"))
    assert len(adapter) == 3 * sp
    shards = list(adapter)
    assert len(shards) == 3 * sp
    # Gather every rank's shards and rebuild each sample from its group's shards, in rank order.
    everything = [None] * sp
    torch.distributed.all_gather_object(everything, shards, group=group)
    for step in range(3 * sp):
        source_rank = group_start + step % sp
        expected = _loader(source_rank, lengths, batch)[step // sp]
        pieces = [everything[r][step] for r in range(sp)]
        assert all(p["tag"] == expected["tag"] for p in pieces)
        assert "labels" not in pieces[0]
        seq = expected["input_ids"].shape[1]
        ids = torch.cat([p["input_ids"] for p in pieces], dim=1)
        shift = torch.cat([p["shift_labels"] for p in pieces], dim=1)
        pos = torch.cat([p["position_ids"] for p in pieces], dim=1)
        padded = -(-seq // sp) * sp
        assert ids.shape[1] == padded and all(p["input_ids"].shape[1] == padded // sp for p in pieces)
        torch.testing.assert_close(ids[:, :seq], expected["input_ids"])
        assert (ids[:, seq:] == 0).all()
        torch.testing.assert_close(pos, torch.arange(padded).repeat(batch, 1))
        # shift_labels[t] = labels[t + 1] over the whole sample, -100 past its end (and in the padding)
        torch.testing.assert_close(shift[:, :seq - 1], expected["labels"][:, 1:])
        assert (shift[:, seq - 1:] == -100).all()
    # The loader is exhausted on every rank together; a second epoch starts again.
    assert len(list(adapter)) == 3 * sp


@pytest.mark.parametrize("world,sp,lengths,batch", [(2, 2, [8, 8, 8], 1), (2, 2, [7, 4, 9], 2), (4, 2, [5, 6, 11], 1),
                                                    (4, 4, [13, 8, 3], 2)])
def test_adapter_shards_tile_each_sample_once(world, sp, lengths, batch):
    run_distributed(_adapter_tiles, world, args=(sp, lengths, batch))


def _adapter_errors():
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    rank = torch.distributed.get_rank()
    batch = _sample(rank, 1, 4)
    batch.pop("position_ids")
    adapter = UlyssesSPDataLoaderAdapter([batch], 0 + rank, None, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="position_ids"):
        next(adapter)
    odd = _sample(rank, 1, 4)
    odd["extra"] = torch.zeros(1, 3)
    adapter = UlyssesSPDataLoaderAdapter([odd], rank, None, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="extra"):
        next(adapter)


def test_adapter_errors_on_every_rank():
    run_distributed(_adapter_errors, 2)


def _group_loss():
    from deepspeed.runtime.sequence_parallel.loss import sequence_parallel_loss
    rank = torch.distributed.get_rank()
    # The full sample: per-token losses of a tiny linear model; rank r holds tokens [3r, 3r+3), rank 1 has no
    # valid token in its first position.
    torch.manual_seed(7)
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(6, 4)
    valid = torch.tensor([1, 1, 1, 0, 1, 1], dtype=torch.bool)
    ref = ((x @ w)[valid]**2).mean()
    (g_ref, ) = torch.autograd.grad(ref, w)
    mine = slice(3 * rank, 3 * rank + 3)
    w_local = w.detach().clone().requires_grad_()
    token_loss = (x[mine] @ w_local)**2
    n = valid[mine].sum()
    shard_loss = token_loss[valid[mine]].mean()
    loss = sequence_parallel_loss(shard_loss, n, None)
    torch.testing.assert_close(loss, ref.detach())
    loss.backward()
    grad = w_local.grad.clone()
    torch.distributed.all_reduce(grad)
    # Each rank backpropagates the same group loss, so the group's gradients add up to P * dL.
    torch.testing.assert_close(grad / 2, g_ref)


def test_sequence_parallel_loss_is_token_weighted():
    run_distributed(_group_loss, 2)
