# SPDX-License-Identifier: Apache-2.0
"""Tiny random-weight Hugging Face decoders and the plain-torch reference of a tensor-parallel run.

The reference trains the unsharded model in plain torch on the same global batch: at each step
the gradient is the mean over the data-parallel ranks' micro-batches and the accumulation steps,
clipped as the engine clips (``min(1, clip / (norm + 1e-6))``), and stepped by the same torch
optimizer. Tensor-parallel ranks of one group see the same micro-batches (their data-parallel
rank's), so the reference needs only the data-parallel layout.
"""

import copy

import torch

VOCAB = 65  # not a multiple of 2 or 4: the LM head's cut is uneven
SEQ = 5


def _llama(tied, uneven):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB,
                      hidden_size=16,
                      intermediate_size=66 if uneven else 32,
                      num_hidden_layers=1,
                      num_attention_heads=4,
                      num_key_value_heads=2,
                      head_dim=4,
                      max_position_embeddings=32,
                      tie_word_embeddings=tied,
                      attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def _mistral(tied, uneven):
    from transformers import MistralConfig, MistralForCausalLM
    # 6 key/value heads: at tp 4 the ranks hold 2, 2, 1, 1 of them
    cfg = MistralConfig(vocab_size=VOCAB,
                        hidden_size=24,
                        intermediate_size=66 if uneven else 32,
                        num_hidden_layers=1,
                        num_attention_heads=6,
                        num_key_value_heads=6,
                        head_dim=4,
                        max_position_embeddings=32,
                        sliding_window=None,
                        tie_word_embeddings=tied,
                        attn_implementation="eager")
    return MistralForCausalLM(cfg)


def _qwen2(tied, uneven):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=VOCAB,
                      hidden_size=16,
                      intermediate_size=66 if uneven else 32,
                      num_hidden_layers=1,
                      num_attention_heads=4,
                      num_key_value_heads=2,
                      max_position_embeddings=32,
                      tie_word_embeddings=tied,
                      attn_implementation="eager")
    return Qwen2ForCausalLM(cfg)


def _qwen3(tied, uneven):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=VOCAB,
                      hidden_size=16,
                      intermediate_size=66 if uneven else 32,
                      num_hidden_layers=1,
                      num_attention_heads=4,
                      num_key_value_heads=2,
                      head_dim=4,
                      max_position_embeddings=32,
                      tie_word_embeddings=tied,
                      attn_implementation="eager")
    return Qwen3ForCausalLM(cfg)


def random_widths(seed):
    """Seeded random widths of a Qwen3 model (heads, key/value heads, head size, hidden, MLP, vocabulary), at least
    as many key/value heads as ranks of tensor-parallel size 2. A failing seed becomes a named case."""
    g = torch.Generator().manual_seed(1000 + seed)

    def pick(lo, hi):
        return int(torch.randint(lo, hi + 1, (1, ), generator=g))

    kv = pick(2, 5)
    return dict(num_key_value_heads=kv,
                num_attention_heads=kv * pick(1, 2),
                head_dim=2 * pick(1, 3),
                hidden_size=pick(5, 24),
                intermediate_size=pick(2, 41),
                vocab_size=pick(17, 70))


def _random_qwen3(seed, tied):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(num_hidden_layers=1,
                      max_position_embeddings=32,
                      tie_word_embeddings=tied,
                      attn_implementation="eager",
                      **random_widths(seed))
    return Qwen3ForCausalLM(cfg)


BUILDERS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3}


def build(kind, tied=False, uneven=True, seed=0, hf_plan=True):
    """A tiny random model, the same on every rank; ``hf_plan=False`` removes its tp_plan (the heuristic runs);
    ``kind`` ``"random"``: seeded random widths (``random_widths(seed)``)."""
    torch.manual_seed(seed)
    model = _random_qwen3(seed, tied) if kind == "random" else BUILDERS[kind](tied, uneven)
    with torch.no_grad():  # the HF init leaves norms at 1 and biases at 0: give every parameter a gradient shape
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    if not hf_plan:  # no plan on the config, the instance or the class: the heuristic path
        model.config.base_model_tp_plan = None
        model._tp_plan = None
        model.__class__ = type(type(model).__name__, (type(model), ), {"_tp_plan": None})
    return model


def batches(steps, gas, dp, seed=1, seq=SEQ, vocab=VOCAB):
    """``[step][micro][dp_rank]`` -> input ids (1 x seq)."""
    g = torch.Generator().manual_seed(seed)
    return [[[torch.randint(0, vocab, (1, seq), generator=g) for _ in range(dp)] for _ in range(gas)]
            for _ in range(steps)]


def make_optimizer(kind, params, lr):
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.99), eps=1e-6)
    return torch.optim.SGD(params, lr=lr)


def reference_run(model, data, optimizer="sgd", lr=0.1, clip=0.0):
    """Train ``model`` (a copy) on ``data`` in plain torch; returns ``(state_dict, [norm per step], [loss])``."""
    model = copy.deepcopy(model).double()
    opt = make_optimizer(optimizer, model.parameters(), lr)
    norms, losses = [], []
    for step in data:
        opt.zero_grad()
        gas, dp = len(step), len(step[0])
        for micro in step:
            for ids in micro:
                loss = model(input_ids=ids, labels=ids).loss
                (loss / (gas * dp)).backward()
                losses.append(float(loss))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = float(torch.sqrt(sum((g.double()**2).sum() for g in grads)))
        norms.append(norm)
        if clip > 0:
            coef = min(1.0, clip / (norm + 1e-6))
            for g in grads:
                g.mul_(coef)
        opt.step()
    return {k: v.float() for k, v in model.state_dict().items()}, norms, losses
