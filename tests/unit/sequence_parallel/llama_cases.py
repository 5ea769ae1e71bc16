# SPDX-License-Identifier: Apache-2.0
"""A tiny random-weight LlamaForCausalLM trained with Ulysses sequence parallelism, against the unsharded model.

Run on every rank (inside a pool worker). Each rank's data loader yields its own sample; the adapter hands each rank
of a sequence-parallel group its shard of the group's first sample; the engine's loss is the group's token-weighted
loss. The reference is the same model in plain torch, on whole samples: the mean over the data-parallel replicas of
each sample's token-mean loss, and its gradients. What the optimizer sees (``safe_get_full_grad``) must equal them.
"""

import copy

import torch

HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB = 16, 2, 4, 2, 37


def tiny_llama(seed=0, kv_heads=KV_HEADS, heads=HEADS, hidden=HIDDEN):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB,
                         hidden_size=hidden,
                         intermediate_size=24,
                         num_hidden_layers=LAYERS,
                         num_attention_heads=heads,
                         num_key_value_heads=kv_heads,
                         max_position_embeddings=64,
                         attn_implementation="sdpa",
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def saved_bytes(fn):
    """The bytes of the storages autograd saves for backward while ``fn()`` runs (each storage once)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def sample(rank, seq):
    """Rank ``rank``'s sample: random tokens, labels 1 and ``seq // 2`` masked, so the first shard of a group has
    fewer valid tokens than the others (a loss that is not token-weighted gets other gradients)."""
    gen = torch.Generator().manual_seed(500 + rank)
    ids = torch.randint(0, VOCAB, (1, seq), generator=gen)
    labels = ids.clone()
    labels[0, 1] = -100
    labels[0, seq // 2] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(seq).unsqueeze(0)}


def sample_loss(model, batch):
    """The token-mean next-token loss of a whole sample (plain torch)."""
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
    return out.loss


def length(rank, seq, variable):
    """Rank ``rank``'s sample length: ``seq``, or ``seq + rank`` for variable lengths."""
    return seq + rank if variable else seq


def reference(model, sp, seq, dtype, gas=1, variable=False):
    """``(per-sample losses, {name: gradient of their mean})``: plain torch, whole samples. The samples are those
    of the first ``gas`` ranks of every sequence-parallel group (micro-batch ``j`` is group rank ``j``'s sample);
    losses are listed group-major."""
    world = torch.distributed.get_world_size()
    ref = copy.deepcopy(model).to(dtype)
    sources = [g + j for g in range(0, world, sp) for j in range(gas)]
    losses = [sample_loss(ref, sample(src, length(src, seq, variable))) for src in sources]
    torch.stack(losses).mean().backward()
    grads = {n: p.grad.float().clone() for n, p in ref.named_parameters() if p.grad is not None}
    return [loss.detach().float() for loss in losses], grads


def engine_config(stage, bf16, world, sp, gas=1):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        # stage 3: every parameter is released between uses (no persistent ones), as for a large model
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0
        },
        "bf16": {
            "enabled": bf16
        },
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "gradient_clipping": 0.0,
    }


def _tiled_loss_sum(self, x, y):
    logits = self.lm_head(x).float()
    return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), y.view(-1), ignore_index=-100, reduction="sum")


def sp_loss(engine, shard, sp_group, tiled_loss=False):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, sequence_parallel_loss
    tokens = (shard["shift_labels"] != -100).sum()
    if tiled_loss:  # the logits in tiles of 3 tokens, the shard's token-mean from the tiles' sums
        model = engine.module
        hidden = model.model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).last_hidden_state
        total = TiledFusedLogitsLoss.apply(_tiled_loss_sum, model, hidden, shard["shift_labels"], None, 2,
                                           [model.lm_head.weight], "sum")
        return sequence_parallel_loss(total / tokens, tokens, sp_group)
    out = engine(input_ids=shard["input_ids"],
                 position_ids=shard["position_ids"],
                 labels=shard["shift_labels"],
                 shift_labels=shard["shift_labels"])
    return sequence_parallel_loss(out.loss, tokens, sp_group)


def assert_grads(engine_model, ref_grads, bf16, names=None):
    from deepspeed.utils import safe_get_full_grad
    seen = 0
    for name, p in engine_model.named_parameters():
        if not p.requires_grad:
            continue
        key = name if names is None else names(name)
        grad = safe_get_full_grad(p)
        expected = ref_grads[key]
        if bf16:
            err = (grad.float() - expected).norm() / expected.norm().clamp(min=1e-6)
            assert err < 4e-2, f"{name}: relative error {err:.3g}"
        else:
            torch.testing.assert_close(grad.float(), expected, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        seen += 1
    assert seen == len(ref_grads), f"compared {seen} gradients, the reference has {len(ref_grads)}"


def run_case(stage,
             bf16,
             sp,
             seq=8,
             lora=False,
             tiled_mlp=False,
             tiled_loss=False,
             gas=1,
             checkpoint_offload=False,
             variable=False,
             recompute_norms=False,
             tiled_layers=False):
    """One optimizer step of ``gas`` micro-batches (``gas <= sp``: the adapter's micro-batches in turn)."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = tiny_llama()
    if lora:
        from peft import LoraConfig, get_peft_model
        torch.manual_seed(1)
        model = get_peft_model(
            model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    if tiled_mlp:
        patch_tiled_mlp(model)
    ref_losses, ref_grads = reference(model, sp, seq, dtype, gas, variable)
    if checkpoint_offload:  # after the reference, which runs without checkpointing
        from deepspeed.runtime.sequence_parallel.activation_offload import enable_checkpoint_offload
        enable_checkpoint_offload(model)
        model.train()
    if tiled_layers:  # after the reference as well: token-wise parts in tiles of 3 tokens of the local shard
        from deepspeed.runtime.sequence_parallel.tiled_layer import enable_tiled_decoder_layers
        assert enable_tiled_decoder_layers(model, tile_tokens=3) == LAYERS
    if recompute_norms:  # after the reference as well
        from deepspeed.runtime.sequence_parallel.recompute import enable_recompute_in_backward
        assert enable_recompute_in_backward(model) > 0
    # variable: each rank's samples of another length (`seq + rank`), which the adapter pads to the group size
    mpu = UlyssesSPAttentionHF.register_with_transformers(model,
                                                          "sdpa",
                                                          sp,
                                                          micro_batch_size=1,
                                                          seq_length=None if variable else seq,
                                                          seq_length_is_variable=variable)
    try:
        engine, *_ = deepspeed.initialize(model=model,
                                          model_parameters=[p for p in model.parameters() if p.requires_grad],
                                          config=engine_config(stage, bf16, world, sp, gas),
                                          mpu=mpu)
        assert engine.dp_world_size == world // sp
        group = mpu.get_sequence_parallel_group()
        loader = UlyssesSPDataLoaderAdapter([sample(rank, length(rank, seq, variable))],
                                            mpu.get_sequence_parallel_rank(), group, sp, torch.device("cpu"))
        tol = dict(atol=1e-2, rtol=1e-2) if bf16 else dict(atol=1e-5, rtol=1e-5)
        for micro in range(gas):
            shard = next(loader)  # group rank `micro`'s sample, this rank's shard
            loss = sp_loss(engine, shard, group, tiled_loss)
            torch.testing.assert_close(loss.float(), ref_losses[rank // sp * gas + micro], **tol)
            engine.backward(loss)
            if micro == gas - 1:
                assert engine.is_gradient_accumulation_boundary()
                assert_grads(engine.module, ref_grads, bf16)
            engine.step()
        engine.destroy()
    finally:
        UlyssesSPAttentionHF.unregister_from_transformers("sdpa")
    return float(loss)


def _tiled_mlp_forward(self, x):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp(module, h):
        return module.down_proj(module.act_fn(module.gate_proj(h)) * module.up_proj(h))

    return TiledMLP.apply(mlp, self, x, 3, None)


def patch_tiled_mlp(model):
    """Every LlamaMLP of ``model`` runs tiled (3 tiles of the local sequence)."""
    import types
    from transformers.models.llama.modeling_llama import LlamaMLP
    for module in model.modules():
        if isinstance(module, LlamaMLP):
            module.forward = types.MethodType(_tiled_mlp_forward, module)
