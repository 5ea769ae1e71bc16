# SPDX-License-Identifier: Apache-2.0
"""The ALST memory tools against the untiled computation: TiledMLP, SequenceTiledCompute, TiledFusedLogitsLoss and
the host-offloaded activation checkpoint give equal values and gradients (single process, plain torch reference)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from deepspeed.runtime.sequence_parallel.activation_offload import checkpoint_offloaded
from deepspeed.runtime.sequence_parallel.ulysses_sp import (SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP,
                                                            sequence_tiled_compute)


class GatedMLP(torch.nn.Module):

    def __init__(self, hidden, inner):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inner, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inner, bias=False)
        self.down_proj = torch.nn.Linear(inner, hidden, bias=True)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _mlp_forward(self, x):
    return GatedMLP.forward(self, x)


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _assert_same_grads(a, b, **tol):
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], **tol)


@pytest.mark.parametrize("shape,shards", [((2, 7, 5), 3), ((9, 4), 4), ((1, 5, 1), 5), ((1, 3, 6), 1)])
@pytest.mark.parametrize("use_compute_params", [True, False])
def test_tiled_mlp_equals_mlp(shape, shards, use_compute_params):
    torch.manual_seed(0)
    mlp = GatedMLP(shape[-1], 3 * shape[-1] + 1)
    ref_mlp = copy.deepcopy(mlp)
    x = torch.randn(*shape, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    w = torch.randn(*shape)
    params = list(mlp.parameters()) if use_compute_params else None
    out = TiledMLP.apply(_mlp_forward, mlp, x, shards, params)
    (out * w).sum().backward()
    ref = ref_mlp(x_ref)
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    _assert_same_grads(_grads(mlp), _grads(ref_mlp))


def test_tiled_mlp_frozen_parameters_get_no_grad():
    torch.manual_seed(1)
    mlp = GatedMLP(4, 6)
    mlp.up_proj.weight.requires_grad_(False)
    x = torch.randn(2, 6, 4, requires_grad=True)
    TiledMLP.apply(_mlp_forward, mlp, x, 2, None).sum().backward()
    assert mlp.up_proj.weight.grad is None and mlp.gate_proj.weight.grad is not None


@pytest.mark.parametrize("reduction,unshard_dim", [(None, 1), ("mean", 1), ("sum", 1), ("sum", 0), ("mean", 0)])
@pytest.mark.parametrize("with_params", [True, False])
def test_sequence_tiled_compute_equals_untiled(reduction, unshard_dim, with_params):
    torch.manual_seed(2)
    mlp = GatedMLP(3, 5)
    ref_mlp = copy.deepcopy(mlp)
    bs, seqlen, shards = 2, 11, 4
    x = torch.randn(bs, seqlen, 3, requires_grad=True)
    scale = torch.randn(bs, seqlen, 1)
    x_ref = x.detach().clone().requires_grad_()

    def fn(hidden, gain, module):
        out = module(hidden) * gain
        return out.sum() if unshard_dim == 0 else out

    out = sequence_tiled_compute(fn,
                                 seqlen,
                                 shards, {
                                     "hidden": x,
                                     "gain": scale
                                 }, {"module": mlp},
                                 "hidden",
                                 compute_params=list(mlp.parameters()) if with_params else None,
                                 output_unshard_dimension=unshard_dim,
                                 output_reduction=reduction)
    step = -(-seqlen // shards)
    tiles = [fn(x_ref[:, i:i + step], scale[:, i:i + step], ref_mlp) for i in range(0, seqlen, step)]
    ref = torch.stack(tiles) if unshard_dim == 0 else torch.cat(tiles, dim=1)
    ref = ref if reduction is None else (ref.mean() if reduction == "mean" else ref.sum())
    w = torch.randn(ref.shape)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    _assert_same_grads(_grads(mlp), _grads(ref_mlp))


def test_sequence_tiled_compute_bad_arguments():
    x = torch.randn(1, 4, 2, requires_grad=True)
    with pytest.raises(ValueError, match="output_reduction"):
        sequence_tiled_compute(lambda h: h, 4, 2, {"h": x}, {}, "h", output_reduction="max")
    with pytest.raises(ValueError, match="grad_requiring_tensor_key"):
        SequenceTiledCompute.apply(lambda h: h, 4, 2, ["h"], [], "y", None, 1, None, x)


class Head(torch.nn.Module):

    def __init__(self, hidden, vocab):
        super().__init__()
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        self.vocab = vocab


def _sum_loss(self, x, y, mask=None):
    logits = self.lm_head(x).float()
    losses = F.cross_entropy(logits.view(-1, self.vocab), y.view(-1), ignore_index=-100, reduction="none")
    if mask is not None:
        losses = losses * mask.view(-1)
    return losses.sum()


@pytest.mark.parametrize("bs,seqlen,shards", [(2, 9, 4), (1, 5, 5), (3, 4, 1)])
@pytest.mark.parametrize("with_mask", [False, True])
def test_tiled_logits_loss_sum_equals_full_cross_entropy(bs, seqlen, shards, with_mask):
    torch.manual_seed(3)
    head = Head(6, 13)
    ref_head = copy.deepcopy(head)
    x = torch.randn(bs, seqlen, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = torch.randint(0, 13, (bs, seqlen))
    y[0, 0] = -100
    mask = (torch.rand(bs, seqlen) > 0.3).float() if with_mask else None
    loss = TiledFusedLogitsLoss.apply(_sum_loss, head, x, y, mask, shards, [head.lm_head.weight], "sum")
    (loss * 0.7).backward()
    ref = _sum_loss(ref_head, x_ref, y, mask)
    (ref * 0.7).backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    _assert_same_grads(_grads(head), _grads(ref_head))


def _weighted_sum(module, x, y):  # in float32, as a loss over logits cast to float32
    return (x.float() * module.weight.float() * y.unsqueeze(-1)).sum()


def test_tiled_logits_loss_scales_16bit_gradients_in_float32():
    # bf16 inputs and weight whose gradients are small integers, a float32 loss divided by 255 after the tiled loss
    # as by a token count: each bf16 gradient is g / 255 rounded once, as autograd gives it. Rounding 1/255 to
    # bf16 first (0.0039368 for 0.0039216) would move every gradient up by 0.39%.
    head = torch.nn.Module()
    head.weight = torch.nn.Parameter(torch.randint(-8, 9, (6, ), dtype=torch.bfloat16))
    ref_head = copy.deepcopy(head)
    x = torch.randint(-8, 9, (1, 12, 6), dtype=torch.bfloat16).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y = torch.randint(-3, 4, (1, 12))
    loss = TiledFusedLogitsLoss.apply(_weighted_sum, head, x, y, None, 4, [head.weight], "sum") / 255
    loss.backward()
    (_weighted_sum(ref_head, x_ref, y) / 255).backward()
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(head.weight.grad, ref_head.weight.grad)
    assert torch.equal(x.grad, (head.weight.float() * y.unsqueeze(-1) / 255).to(torch.bfloat16))


def test_tiled_logits_loss_mean_is_the_mean_of_tile_losses():
    torch.manual_seed(4)
    head = Head(4, 7)
    ref_head = copy.deepcopy(head)
    x = torch.randn(1, 10, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = torch.randint(0, 7, (1, 10))
    loss = TiledFusedLogitsLoss.apply(_sum_loss, head, x, y, None, 3, None, "mean")
    loss.backward()
    flat_x, flat_y = x_ref.reshape(10, 4), y.reshape(10)
    ref = torch.stack([_sum_loss(ref_head, a, b) for a, b in zip(flat_x.chunk(3), flat_y.chunk(3))]).mean()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    _assert_same_grads(_grads(head), _grads(ref_head))


def test_tiled_logits_loss_without_grad_and_bad_shapes():
    head = Head(4, 5)
    x, y = torch.randn(2, 3, 4), torch.randint(0, 5, (2, 3))
    with torch.no_grad():
        loss = TiledFusedLogitsLoss.apply(_sum_loss, head, x, y, None, 2, None, "sum")
    torch.testing.assert_close(loss, _sum_loss(head, x, y).detach())
    assert head.lm_head.weight.grad is None
    with pytest.raises(ValueError, match="agree"):
        TiledFusedLogitsLoss.apply(_sum_loss, head, x, y[:, :2], None, 2, None, "sum")
    with pytest.raises(ValueError, match="reduction"):
        TiledFusedLogitsLoss.apply(_sum_loss, head, x, y, None, 2, None, "max")


class Block(torch.nn.Module):

    def __init__(self, width):
        super().__init__()
        self.mlp = GatedMLP(width, 2 * width)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x, scale=1.0):
        return x + self.dropout(self.mlp(x)) * scale


@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_offloaded_checkpoint_equals_plain_forward(input_requires_grad):
    torch.manual_seed(5)
    blocks = torch.nn.ModuleList([Block(4) for _ in range(3)])
    ref_blocks = copy.deepcopy(blocks)
    x = torch.randn(2, 5, 4, requires_grad=input_requires_grad)
    x_ref = x.detach().clone().requires_grad_(input_requires_grad)
    torch.manual_seed(9)
    h = x
    for block in blocks:
        h = checkpoint_offloaded(block, h, scale=0.5)
    torch.manual_seed(9)
    h_ref = x_ref
    for block in ref_blocks:
        h_ref = block(h_ref, scale=0.5)
    w = torch.randn(h.shape)
    (h * w).sum().backward()
    (h_ref * w).sum().backward()
    torch.testing.assert_close(h, h_ref)
    _assert_same_grads(_grads(blocks), _grads(ref_blocks))
    if input_requires_grad:
        torch.testing.assert_close(x.grad, x_ref.grad)
