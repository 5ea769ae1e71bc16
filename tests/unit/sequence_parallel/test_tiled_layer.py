# SPDX-License-Identifier: Apache-2.0
"""enable_tiled_decoder_layers: a model whose layers run their token-wise parts in tiles gives the loss and every
gradient of the plain model (the same operations on the same values, parameter gradients summed over tiles), keeps
less for backward, and refuses layers of another structure. The reference is the untouched HF model in plain
torch. Random shapes (odd widths, one-token tiles, tiles longer than the sequence) come from a seeded generator."""

import copy
import random

import pytest
import torch

from deepspeed.runtime.sequence_parallel.tiled_layer import enable_tiled_decoder_layers, tiled

from tests.unit.sequence_parallel.llama_cases import saved_bytes

pytest.importorskip("transformers")


def _model(family, hidden=24, heads=4, kv_heads=2, head_dim=6, inner=40, layers=2, seed=3, dtype=torch.float64):
    import transformers
    configs = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {
            "sliding_window": 5
        }),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    }
    config_name, model_name, extra = configs[family]
    config = getattr(transformers, config_name)(vocab_size=53,
                                                hidden_size=hidden,
                                                intermediate_size=inner,
                                                num_hidden_layers=layers,
                                                num_attention_heads=heads,
                                                num_key_value_heads=kv_heads,
                                                head_dim=head_dim,
                                                max_position_embeddings=128,
                                                attn_implementation="sdpa",
                                                use_cache=False,
                                                **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype)
    with torch.no_grad():  # nonzero biases and norm weights, so their gradients are tested too
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _loss_and_grads(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(model_a, model_b, ids, tol, **kwargs):
    ref_loss, ref_grads = _loss_and_grads(model_a, ids, **kwargs)
    loss, grads = _loss_and_grads(model_b, ids, **kwargs)
    torch.testing.assert_close(loss, ref_loss, **tol)
    assert ref_grads.keys() == grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **tol, msg=lambda m: f"{name}: {m}")


FP64 = dict(rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("seq,tile", [(9, 4), (16, 16), (5, 1), (7, 100)])
def test_equals_the_plain_model(family, seq, tile):
    plain = _model(family)
    tiled = copy.deepcopy(plain)
    assert enable_tiled_decoder_layers(tiled, tile_tokens=tile) == 2
    assert enable_tiled_decoder_layers(tiled, tile_tokens=tile) == 0  # once only
    ids = torch.randint(0, 53, (2, seq), generator=torch.Generator().manual_seed(seq))
    _assert_same(plain, tiled, ids, FP64)


def test_random_shapes():
    rng = random.Random(20261202)
    for _ in range(6):
        heads = rng.choice([1, 2, 4])
        kv_heads = rng.choice([h for h in (1, 2, 4) if heads % h == 0])
        head_dim = rng.choice([2, 4, 6])
        hidden, inner = heads * (rng.randint(0, 4) * 2 + 1), rng.randint(1, 17)  # odd widths, 1-wide MLPs
        seq, tile = rng.randint(1, 13), rng.randint(1, 6)
        family = rng.choice(["llama", "qwen3"])
        plain = _model(family, hidden, heads, kv_heads, head_dim, inner, layers=1, seed=rng.randint(0, 99))
        tiled = copy.deepcopy(plain)
        enable_tiled_decoder_layers(tiled, tile_tokens=tile)
        ids = torch.randint(0, 53, (rng.randint(1, 2), seq), generator=torch.Generator().manual_seed(seq))
        _assert_same(plain, tiled, ids, FP64)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, dict(rtol=1e-4, atol=1e-6)),
                                       (torch.bfloat16, dict(rtol=2e-2, atol=2e-2))])
def test_with_offloaded_checkpoints_and_low_precision(dtype, tol):
    from deepspeed.runtime.sequence_parallel.activation_offload import enable_checkpoint_offload
    plain = _model("llama", dtype=dtype)
    tiled = copy.deepcopy(plain)
    enable_tiled_decoder_layers(tiled, tile_tokens=3)
    enable_checkpoint_offload(tiled)
    tiled.train()
    ids = torch.randint(0, 53, (1, 11), generator=torch.Generator().manual_seed(0))
    _assert_same(plain, tiled, ids, tol)


def test_lora_adapters_get_their_gradients():
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    plain = peft.get_peft_model(_model("llama"),
                                peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                init_lora_weights=False))
    tiled = copy.deepcopy(plain)
    assert enable_tiled_decoder_layers(tiled, tile_tokens=2) == 2
    ids = torch.randint(0, 53, (1, 7), generator=torch.Generator().manual_seed(1))
    _assert_same(plain, tiled, ids, FP64)
    assert sum("lora" in n for n, p in tiled.named_parameters() if p.grad is not None) == 2 * 3 * 2


def test_a_kv_cache_is_updated_as_by_the_plain_layers():
    from transformers import DynamicCache
    plain = _model("llama").eval()
    tiled = copy.deepcopy(plain)
    enable_tiled_decoder_layers(tiled, tile_tokens=2)
    ids = torch.randint(0, 53, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        outs = []
        for model in (plain, tiled):
            cache = DynamicCache(config=model.config)
            first = model(input_ids=ids[:, :5], past_key_values=cache, use_cache=True).logits
            second = model(input_ids=ids[:, 5:], past_key_values=cache, use_cache=True).logits
            outs.append((first, second))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, **FP64)


def test_keeps_less_for_backward():

    def kept(model, ids):
        return saved_bytes(lambda: model.model(input_ids=ids))

    hidden, seq = 32, 64
    plain = _model("llama", hidden=hidden, heads=4, kv_heads=2, head_dim=8, inner=64, layers=1, dtype=torch.bfloat16)
    tiled = copy.deepcopy(plain)
    enable_tiled_decoder_layers(tiled, tile_tokens=16)
    ids = torch.randint(0, 53, (1, seq), generator=torch.Generator().manual_seed(0))
    tiled_bytes, plain_bytes = kept(tiled, ids), kept(plain, ids)
    # the tiled layer keeps its input, q, k, v and the attention's output (and the final norm and the rotary
    # tables outside it); the plain one keeps at least the MLP's three [seq, inner] intermediates besides
    assert tiled_bytes < plain_bytes - 3 * seq * 64 * 2
    bound = seq * 2 * (hidden + 4 * 8 + 2 * 2 * 8 + 4 * 8)  # input, q, k, v, output (bf16)
    bound += seq * hidden * (4 + 2) + 2 * seq * 8 * 4 + seq * hidden * 2  # final norm, rotary tables, its input
    assert tiled_bytes <= bound + 4096, (tiled_bytes, bound)


def test_tiled_tokenwise_alone_equals_the_function():
    torch.manual_seed(0)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    a = torch.randn(2, 7, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, 7, 3, dtype=torch.float64)  # batch 1 broadcasts; no gradient wanted

    def fn(_, x, y):
        return torch.tanh(x @ w) * y, (x * x).sum(-1, keepdim=True)

    ref = fn(None, a, b)
    (ref[0].sum() + 3 * ref[1].sum()).backward()
    ref_a, ref_w = a.grad.clone(), w.grad.clone()
    a.grad, w.grad = None, None
    out = tiled(fn, None, 3, [w], a, b)
    for x, y in zip(out, ref):
        torch.testing.assert_close(x, y, **FP64)
    (out[0].sum() + 3 * out[1].sum()).backward()
    torch.testing.assert_close(a.grad, ref_a, **FP64)
    torch.testing.assert_close(w.grad, ref_w, **FP64)
    # one output unused: its gradient is None, the other's still flows
    a.grad, w.grad = None, None
    tiled(fn, None, 2, [w], a, b)[1].sum().backward()
    torch.testing.assert_close(a.grad, 2 * a.detach(), **FP64)
    assert w.grad is None
    # no input requires a gradient, a parameter does: the output still takes part in autograd
    w.grad = None
    tiled(fn, None, 4, [w], a.detach(), b)[0].sum().backward()
    torch.testing.assert_close(w.grad, torch.autograd.grad(fn(None, a.detach(), b)[0].sum(), w)[0], **FP64)


def test_other_layers_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11))
    with pytest.raises(NotImplementedError, match="supports"):
        enable_tiled_decoder_layers(torch.nn.ModuleDict({"layer": _Fake()}))
    assert enable_tiled_decoder_layers(model) == 0  # no decoder layer class to speak of: nothing changes
    with pytest.raises(ValueError, match="positive"):
        enable_tiled_decoder_layers(_model("llama"), tile_tokens=0)


class _Fake(torch.nn.Module):
    pass


_Fake.__name__ = "GemmaDecoderLayer"


def test_an_older_transformers_is_refused(monkeypatch):
    import transformers
    monkeypatch.setattr(transformers, "__version__", "4.56.2")
    with pytest.raises(NotImplementedError, match="transformers >= 4.57"):
        enable_tiled_decoder_layers(_model("llama"))
