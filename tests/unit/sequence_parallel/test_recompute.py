# SPDX-License-Identifier: Apache-2.0
"""enable_recompute_in_backward: a model whose norms rerun in backward gives the loss and every gradient of the
plain model (the same operations on the same values): bit for bit in bf16, where the norm reads its input once
(through the float32 cast); in float32 the norm reads the input itself twice, and the plain graph sums those two
gradients with the residual's in another order, so the float32 gradients agree up to that rounding."""

import copy

import pytest
import torch

from deepspeed.runtime.sequence_parallel.recompute import enable_recompute_in_backward, is_norm

from tests.unit.sequence_parallel.llama_cases import saved_bytes

pytest.importorskip("transformers")


def _llama(dtype, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=97,
                         hidden_size=24,
                         intermediate_size=40,
                         num_hidden_layers=layers,
                         num_attention_heads=4,
                         num_key_value_heads=2,
                         head_dim=6,
                         attn_implementation="sdpa")
    torch.manual_seed(3)
    return LlamaForCausalLM(config).to(dtype)


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq", [2, 5, 16])
def test_bit_identical_to_the_plain_model(dtype, seq):
    plain = _llama(dtype)
    recomputed = copy.deepcopy(plain)
    assert enable_recompute_in_backward(recomputed) == 2 * 2 + 1  # two per layer and the final norm
    assert enable_recompute_in_backward(recomputed) == 0  # once only
    ids = torch.randint(0, 97, (2, seq), generator=torch.Generator().manual_seed(seq))
    ref_loss, ref_grads = _loss_and_grads(plain, ids)
    loss, grads = _loss_and_grads(recomputed, ids)
    assert torch.equal(loss, ref_loss)
    assert ref_grads.keys() == grads.keys()
    for name in ref_grads:
        if dtype == torch.bfloat16:
            assert torch.equal(grads[name], ref_grads[name]), name
        else:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_under_no_grad_and_a_frozen_norm_it_is_the_plain_forward():
    norm = torch.nn.LayerNorm(7)
    x = torch.randn(3, 7)
    ref = norm(x)
    enable_recompute_in_backward(norm)
    with torch.no_grad():
        assert torch.equal(norm(x), ref)
    norm.requires_grad_(False)
    out = norm(x)
    assert out.grad_fn is None and torch.equal(out, ref)
    assert is_norm(norm) and not is_norm(torch.nn.Linear(2, 2))


def test_keeps_less_for_backward():

    def kept(model, ids):
        return saved_bytes(lambda: model(input_ids=ids, labels=ids).loss)

    plain = _llama(torch.bfloat16, layers=1)
    recomputed = copy.deepcopy(plain)
    enable_recompute_in_backward(recomputed)
    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(0))
    # each RMSNorm kept its float32 input and its normalised value; now it keeps only its input
    assert kept(recomputed, ids) < kept(plain, ids) - 3 * 64 * 24 * 4
