# SPDX-License-Identifier: Apache-2.0
"""The long-sequence memory tools on a GPU, where their fast paths run: pinned host copies of checkpointed inputs
(power-of-two pieces, asynchronous copies) and the tiled decoder layers around flash attention.

* *host copy*: a bf16 tensor of more than one piece goes to pinned memory and back bit for bit, also when the
  device tensor is overwritten right after the copy is queued (the stream orders them);
* *tiled layers*: a bf16 Llama with sdpa (the flash kernel) trained with tiled layers inside offloaded
  checkpoints gives the loss and gradients of the plain model (bf16: relative error of each gradient), and its
  step's peak memory is lower.

``python -m pytest tests/gpu/test_long_sequence.py`` (skipped without CUDA), or ``python -m
tests.gpu.test_long_sequence`` (one line per check).
"""

import copy
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_pinned_host_copy_round_trips():
    from deepspeed.runtime.sequence_parallel import activation_offload as ao
    t = torch.randn(ao._PIECE // 2 + 12345, 3, device="cuda").to(torch.bfloat16)  # > one piece, odd rest
    ref = t.clone()
    host = ao._to_host(t, pin_memory=True)
    assert isinstance(host, ao._HostCopy) and all(p.is_pinned() for p in host.pieces)
    assert sum(p.numel() for p in host.pieces) == t.numel() * t.element_size()
    t.fill_(7.0)  # queued after the copies on the same stream
    back = host.to(t.device)
    torch.cuda.synchronize()
    assert torch.equal(back, ref)


def _llama(layers=3, hidden=512, heads=8, kv_heads=2, inner=1536):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=1000,
                         hidden_size=hidden,
                         intermediate_size=inner,
                         num_hidden_layers=layers,
                         num_attention_heads=heads,
                         num_key_value_heads=kv_heads,
                         head_dim=hidden // heads,
                         max_position_embeddings=1 << 16,
                         attn_implementation="sdpa",
                         use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16)


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}, peak


@needs_cuda
def test_tiled_layers_in_offloaded_checkpoints_match_the_plain_model():
    pytest.importorskip("transformers")
    from deepspeed.runtime.sequence_parallel.activation_offload import enable_checkpoint_offload
    from deepspeed.runtime.sequence_parallel.tiled_layer import enable_tiled_decoder_layers
    plain = _llama()
    tools = copy.deepcopy(plain)
    checkpointed = copy.deepcopy(plain)
    enable_checkpoint_offload(checkpointed)
    enable_checkpoint_offload(tools)
    assert enable_tiled_decoder_layers(tools, tile_tokens=1024) == 3
    for m in (plain, tools, checkpointed):
        m.train()
    ids = torch.randint(0, 1000, (1, 8192), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    ref_loss, ref_grads, _ = _step(plain, ids)
    _, _, checkpointed_peak = _step(checkpointed, ids)
    loss, grads, peak = _step(tools, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    for name, ref in ref_grads.items():
        err = (grads[name] - ref).norm() / ref.norm().clamp(min=1e-6)
        assert err < 2e-2, f"{name}: relative error {err:.3g}"
    # the layer's recomputation keeps q, k, v, the attention output and its input instead of every activation
    assert peak < 0.8 * checkpointed_peak, (peak, checkpointed_peak)


def main():
    checks = [test_pinned_host_copy_round_trips, test_tiled_layers_in_offloaded_checkpoints_match_the_plain_model]
    failed = 0
    for check in checks:
        try:
            check()
            print(f"PASS {check.__name__}", flush=True)
        except Exception as exc:  # report every check
            failed += 1
            print(f"FAIL {check.__name__}: {type(exc).__name__}: {exc}", flush=True)
    print(f"{len(checks) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
