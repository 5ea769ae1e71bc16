# SPDX-License-Identifier: Apache-2.0
"""Tensor-parallel (AutoTP) training throughput and memory: this package against upstream DeepSpeed, one system a run.

A Llama-3-8B-shaped causal LM (Hugging Face ``LlamaForCausalLM``, random weights: d_model 4096, MLP 14336, 32
heads, 8 key/value heads, vocabulary 128256; ``--layers`` of its 32 decoder layers, 8 by default, so that it trains
on one GPU) in bf16 with AdamW, ZeRO ``--stage``, trains ``--warmup`` + ``--steps`` steps on random tokens:

* ``plain``: ``deepspeed.initialize`` without a ``tensor_parallel`` section;
* ``autotp``: the model cut by the tensor-parallel machinery first (``TpTrainingManager(model, tp, bf16)``: the
  model's tp_plan applied, every linear layer of the decoder replaced by its tensor-parallel layer) and then
  ``deepspeed.initialize`` with ``tensor_parallel.autotp_size`` = tp. At tp 1 (one GPU) the collectives are
  skipped and what is measured is the cost of the machinery itself: the layers, the autograd functions.
  Upstream's ``deepspeed.initialize`` does nothing at ``autotp_size`` 1, so its ``TpTrainingManager`` is what
  puts its layers in.

With several GPUs (``torchrun --nproc_per_node N ... --tp N``) the ``autotp`` system runs at tensor-parallel size
N through ``deepspeed.initialize`` alone, as a user would (the TpTrainingManager step is only for tp 1).

Each run prints one JSON line: median step time, tokens/s (over the data-parallel ranks), peak allocated memory
over the timed steps (``torch.cuda.max_memory_allocated``, reset after the warm-up), the first and last loss, and the
``deepspeed`` it imported. ``bash benchmarks/tp_bench.sh WHEELS OUT [NGPUS]`` runs every system, ours and
upstream's (``SMOKE=1``: a tiny model on the CPU, to check the script).
"""

import argparse
import json
import os
import statistics
import time


def build_model(args, dtype, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=args.vocab,
                      hidden_size=args.d_model,
                      intermediate_size=args.mlp,
                      num_hidden_layers=args.layers,
                      num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads,
                      max_position_embeddings=args.seq,
                      rope_theta=500000.0,
                      tie_word_embeddings=False,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype)


def ds_config(args, upstream):
    optimizer = {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}}
    if upstream:
        optimizer["params"]["torch_adam"] = True  # no JIT build of upstream's fused Adam
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {
            "enabled": True
        },
        "optimizer": optimizer,
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": args.stage,
            "overlap_comm": True,
            "reduce_bucket_size": int(5e8)
        }
    }
    if args.system == "autotp":
        cfg["tensor_parallel"] = {"autotp_size": args.tp}
    return cfg


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", required=True, choices=["plain", "autotp"])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d_model", type=int, default=4096)
    parser.add_argument("--mlp", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro_batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the script")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import torch
    import deepspeed
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    upstream = not os.path.abspath(deepspeed.__file__).startswith(repo + os.sep)
    result = {
        "system": ("upstream_" if upstream else "") + args.system,
        "tp": args.tp,
        "stage": args.stage,
        "micro_batch": args.micro_batch,
        "deepspeed": deepspeed.__version__,
        "deepspeed_file": deepspeed.__file__
    }
    cuda = args.device == "cuda"
    if int(os.environ["RANK"]) == 0:
        print(f"{result['system']}: deepspeed {deepspeed.__version__} from {deepspeed.__file__}", flush=True)
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    world = torch.distributed.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    try:
        model = build_model(args, torch.bfloat16, device)
        if args.system == "autotp" and args.tp == 1:
            from deepspeed.module_inject.layers import set_autotp_mode
            from deepspeed.runtime.tensor_parallel import TpTrainingManager
            # as initialize does first: without it upstream's manager takes its inference path
            set_autotp_mode(training=True)
            TpTrainingManager(model, tp_size=1, dtype=torch.bfloat16)
            result["tp_layers"] = sum(1 for m in model.modules()
                                      if "Linear" in type(m).__name__ and type(m).__module__.startswith("deepspeed"))
        t0 = time.time()
        engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config(args, upstream))
        result["initialize_s"] = round(time.time() - t0, 2)
        from deepspeed.utils import groups
        dp = world // args.tp
        dp_rank = groups.get_data_parallel_rank() if args.tp > 1 else torch.distributed.get_rank()
        g = torch.Generator(device="cpu").manual_seed(1234 + dp_rank)
        times, losses = [], []
        for step in range(args.warmup + args.steps):
            ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g).to(device)
            if step == args.warmup and cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            start = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            sync()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
            losses.append(float(loss))
        median = statistics.median(times)
        result.update(median_step_s=round(median, 4),
                      tokens_per_s=round(args.micro_batch * args.seq * dp / median, 1),
                      peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                      first_loss=round(losses[0], 4),
                      last_loss=round(losses[-1], 4),
                      step_times=[round(t, 4) for t in times])
    except Exception as err:  # a system that cannot run reports why, the next one runs
        result["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    if torch.distributed.get_rank() == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
