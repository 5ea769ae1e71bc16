# SPDX-License-Identifier: Apache-2.0
"""MoE training throughput and peak memory on one GPU: this package's AutoEP against upstream DeepSpeed.

A causal LM with random weights (``--model``):

* ``qwen3_moe``: ``Qwen3MoeForCausalLM`` (default 12 layers, d_model 1024, 64 experts of width 768, top-8);
* ``qwen3_6_moe``: Qwen3.6-MoE-shaped ``Qwen3_5MoeForCausalLM`` (the text backbone, 8 layers, d_model 1024:
  three gated-delta-net layers to one attention layer, 64 experts of width 512, top-8, one gated shared expert
  of width 512);
* ``deepseek_v3``: DeepSeek-V3-shaped ``DeepseekV3ForCausalLM`` (8 layers, d_model 1024, MLA attention, the
  first layer dense, 64 routed experts of width 512 in 8 groups (top-4 groups), top-8, sigmoid routing, one
  shared expert);

seq 2048, micro-batch 1, bf16, AdamW, trains for ``--warmup`` + ``--steps`` steps under one system per process:

* ``ours``: this package, ``expert_parallel`` (AutoEP, ep 1: grouped experts), ZeRO stage 3;
* ``ours_z2``: the same on ZeRO stage 2;
* ``ours_z3_leaf``: this package, ZeRO-3 with the sparse MoE block as a leaf module;
* ``upstream_z3_leaf``: upstream's ZeRO-3 with the sparse MoE block as a leaf module (the model's
  own experts, Hugging Face's ``grouped_mm`` experts implementation where available);
* ``upstream_autoep``: upstream's AutoEP (``expert_parallel``, ep 1), ZeRO stage ``--upstream-autoep-stage``.

Each run prints one JSON line: median step time, tokens/s, peak allocated memory over the timed
steps (``torch.cuda.max_memory_allocated``, reset after the warm-up) and the ``deepspeed`` it
imported. Run every system and model in one device call with ``bash benchmarks/moe_bench.sh UPSTREAM``.
``--device cpu --tiny`` is a smoke run of the script's logic.
"""

import argparse
import json
import os
import statistics
import sys
import time

BLOCKS = {
    "qwen3_moe": "Qwen3MoeSparseMoeBlock",
    "qwen3_6_moe": "Qwen3_5MoeSparseMoeBlock",
    "deepseek_v3": "DeepseekV3MoE"
}
PRESETS = {"qwen3_moe": "qwen3_moe", "qwen3_6_moe": "qwen3_5_moe", "deepseek_v3": "deepseek_v3"}


def _config(args):
    """The model's HF config (sizes from ``args``)."""
    heads = max(1, args.d_model // 128)
    if args.model == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(vocab_size=args.vocab,
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
    if args.model == "qwen3_6_moe":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
        types = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(args.layers)]
        return Qwen3_5MoeTextConfig(vocab_size=args.vocab,
                                    hidden_size=args.d_model,
                                    moe_intermediate_size=args.expert_width,
                                    shared_expert_intermediate_size=args.expert_width,
                                    num_hidden_layers=args.layers,
                                    num_attention_heads=heads,
                                    num_key_value_heads=max(1, heads // 4),
                                    head_dim=128 if not args.tiny else 8,
                                    num_experts=args.experts,
                                    num_experts_per_tok=args.top_k,
                                    max_position_embeddings=args.seq,
                                    linear_num_key_heads=heads,
                                    linear_num_value_heads=2 * heads,
                                    linear_key_head_dim=128 if not args.tiny else 8,
                                    linear_value_head_dim=128 if not args.tiny else 8,
                                    layer_types=types,
                                    output_router_logits=True,
                                    router_aux_loss_coef=0.001,
                                    attn_implementation="sdpa")
    from transformers import DeepseekV3Config
    return DeepseekV3Config(vocab_size=args.vocab,
                            hidden_size=args.d_model,
                            intermediate_size=args.d_model * 3,
                            moe_intermediate_size=args.expert_width,
                            num_hidden_layers=args.layers,
                            num_attention_heads=heads,
                            num_key_value_heads=heads,
                            n_routed_experts=args.experts,
                            n_shared_experts=1,
                            num_experts_per_tok=args.top_k,
                            first_k_dense_replace=1,
                            n_group=8 if args.experts % 8 == 0 and args.experts >= 32 else 2,
                            topk_group=4 if args.experts % 8 == 0 and args.experts >= 32 else 1,
                            kv_lora_rank=args.d_model // 2,
                            q_lora_rank=args.d_model,
                            qk_rope_head_dim=32 if not args.tiny else 4,
                            qk_nope_head_dim=64 if not args.tiny else 4,
                            v_head_dim=64 if not args.tiny else 4,
                            routed_scaling_factor=2.5,
                            norm_topk_prob=True,
                            max_position_embeddings=args.seq,
                            attn_implementation="sdpa")


def build_model(args, dtype, device):
    import torch
    from transformers import AutoModelForCausalLM
    cfg = _config(args)
    if args.hf_experts:
        cfg._experts_implementation = args.hf_experts
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for module in model.modules():  # the HF init leaves some routers at zero: give them something to route with
            if type(module).__name__.endswith(("TopKRouter", "TopkRouter")):
                module.weight.normal_(0, 0.02)
    return model.to(dtype)


ZERO3 = {
    "stage": 3,
    "overlap_comm": True,
    "stage3_prefetch_bucket_size": int(5e7),
    "stage3_param_persistence_threshold": int(1e5)
}


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
    if args.system in ("ours", "ours_z2", "upstream_autoep"):
        cfg["expert_parallel"] = {
            "enabled": True,
            "autoep_size": 1,
            "preset_model": PRESETS[args.model],
            "use_grouped_mm": True
        }
    if args.system == "upstream_autoep" and args.upstream_autoep_stage == 3:
        cfg["zero_optimization"] = dict(ZERO3)
    elif args.system == "upstream_autoep":
        cfg["zero_optimization"]["stage"] = args.upstream_autoep_stage
    if args.system == "ours":
        cfg["zero_optimization"] = dict(ZERO3)
    if args.system.endswith("z3_leaf"):
        cfg["zero_optimization"] = dict(ZERO3)
    return cfg


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--system",
                        required=True,
                        choices=["ours", "ours_z2", "ours_z3_leaf", "upstream_z3_leaf", "upstream_autoep"])
    parser.add_argument("--model", default="qwen3_moe", choices=sorted(BLOCKS))
    parser.add_argument("--layers", type=int, default=None, help="default: 12 (qwen3_moe), else 8")
    parser.add_argument("--d_model", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--expert_width", type=int, default=None, help="default: 768 (qwen3_moe), else 512")
    parser.add_argument("--top_k", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--upstream-autoep-stage", dest="upstream_autoep_stage", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hf_experts", default="grouped_mm", help="HF experts implementation for upstream runs")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the script")
    args = parser.parse_args()
    if args.layers is None:
        args.layers = 12 if args.model == "qwen3_moe" else 8
    if args.expert_width is None:
        args.expert_width = 768 if args.model == "qwen3_moe" else 512
    if args.tiny:
        args.layers, args.d_model, args.experts, args.expert_width, args.top_k = 4, 64, 8, 16, 2
        args.seq, args.vocab = 32, 128
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import torch
    import deepspeed
    result = {
        "system": args.system,
        "model": args.model,
        "deepspeed": deepspeed.__version__,
        "deepspeed_file": deepspeed.__file__
    }
    if args.system in ("ours", "ours_z2") or args.device == "cpu":
        args.hf_experts = None
    cuda = args.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    try:
        if cuda:
            torch.cuda.set_device(0)
        model = build_model(args, torch.bfloat16, args.device)
        if args.system.endswith("z3_leaf"):
            block = next(type(m) for m in model.modules() if type(m).__name__ == BLOCKS[args.model])
            deepspeed.utils.set_z3_leaf_modules(model, [block])
        config = ds_config(args)
        result["zero_stage"] = config["zero_optimization"]["stage"]
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
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
                      loss=float(loss.detach()),
                      params_m=round(sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()) / 1e6, 1))
    except Exception as err:  # noqa: BLE001 - a system that fails is reported, the others still run
        result.update(ok=False, error=f"{type(err).__name__}: {str(err)[:400]}")
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
