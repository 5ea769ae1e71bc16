# SPDX-License-Identifier: Apache-2.0
"""MoE training throughput and peak memory on one GPU: this package's AutoEP against upstream DeepSpeed.

A Qwen3-MoE-shaped causal LM (Hugging Face ``Qwen3MoeForCausalLM``, random weights; default 12
layers, d_model 1024, 64 experts of width 768, top-8, seq 2048, micro-batch 1, bf16, AdamW) trains
for ``--warmup`` + ``--steps`` steps under one system per process:

* ``ours``: this package, ``expert_parallel`` (AutoEP, ep 1: grouped experts), ZeRO stage 2;
* ``upstream_z3_leaf``: upstream's ZeRO-3 with the sparse MoE block as a leaf module (the model's
  own experts, Hugging Face's ``grouped_mm`` experts implementation where available);
* ``upstream_autoep``: upstream's AutoEP (``expert_parallel``, ep 1), ZeRO stage 2.

Each run prints one JSON line: median step time, tokens/s, peak allocated memory over the timed
steps (``torch.cuda.max_memory_allocated``, reset after the warm-up) and the ``deepspeed`` it
imported. Run every system in one device call with ``bash benchmarks/moe_bench.sh UPSTREAM_DIR``.
"""

import argparse
import json
import os
import statistics
import sys
import time


def build_model(args, dtype, device):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=args.vocab,
                         hidden_size=args.d_model,
                         intermediate_size=args.d_model * 3,
                         moe_intermediate_size=args.expert_width,
                         num_hidden_layers=args.layers,
                         num_attention_heads=args.d_model // 64,
                         num_key_value_heads=max(1, args.d_model // 256),
                         head_dim=64,
                         num_experts=args.experts,
                         num_experts_per_tok=args.top_k,
                         max_position_embeddings=args.seq,
                         decoder_sparse_step=1,
                         norm_topk_prob=True,
                         output_router_logits=True,
                         router_aux_loss_coef=0.001,
                         attn_implementation="sdpa")
    if args.hf_experts:
        cfg._experts_implementation = args.hf_experts
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.02)  # the HF init leaves the router at zero
    return model.to(dtype)


def ds_config(args):
    optimizer = {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}}
    if args.system.startswith("upstream"):
        optimizer["params"]["torch_adam"] = True  # no JIT build of upstream's fused Adam
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {
            "enabled": True
        },
        "optimizer": optimizer,
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": True,
            "reduce_bucket_size": int(5e8)
        }
    }
    if args.system in ("ours", "upstream_autoep"):
        cfg["expert_parallel"] = {
            "enabled": True,
            "autoep_size": 1,
            "preset_model": "qwen3_moe",
            "use_grouped_mm": True
        }
    if args.system == "upstream_z3_leaf":
        cfg["zero_optimization"] = {
            "stage": 3,
            "overlap_comm": True,
            "stage3_prefetch_bucket_size": int(5e7),
            "stage3_param_persistence_threshold": int(1e5)
        }
    return cfg


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", required=True, choices=["ours", "upstream_z3_leaf", "upstream_autoep"])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d_model", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--expert_width", type=int, default=768)
    parser.add_argument("--top_k", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hf_experts", default="grouped_mm", help="HF experts implementation for upstream runs")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the script")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import torch
    import deepspeed
    result = {"system": args.system, "deepspeed": deepspeed.__version__, "deepspeed_file": deepspeed.__file__}
    if args.system == "ours":
        args.hf_experts = None
    cuda = args.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    try:
        if cuda:
            torch.cuda.set_device(0)
        model = build_model(args, torch.bfloat16, args.device)
        if args.system == "upstream_z3_leaf":
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
            deepspeed.utils.set_z3_leaf_modules(model, [Qwen3MoeSparseMoeBlock])
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               model_parameters=model.parameters(),
                                               config=ds_config(args))
        gen = torch.Generator(device=args.device).manual_seed(1)
        times = []
        for step in range(args.warmup + args.steps):
            if step == args.warmup and cuda:
                sync()
                torch.cuda.reset_peak_memory_stats()
            ids = torch.randint(0, args.vocab, (1, args.seq), device=args.device, generator=gen)
            sync()
            start = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            sync()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        median = statistics.median(times)
        result.update(ok=True,
                      median_step_s=round(median, 4),
                      tokens_per_s=round(args.seq / median, 1),
                      peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                      loss=float(loss),
                      params_m=round(sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()) / 1e6, 1))
    except Exception as err:  # noqa: BLE001 - a system that fails is reported, the others still run
        result.update(ok=False, error=f"{type(err).__name__}: {str(err)[:400]}")
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
