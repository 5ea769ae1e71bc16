# SPDX-License-Identifier: Apache-2.0
"""Pipeline-parallel training of the GPT-style decoder of ``gpt.py``: tokens/s and peak memory per GPU.

The model is ``gpt.GPT`` (token embedding plus learned positions, pre-LayerNorm ``gpt.Block``s, final LayerNorm,
output head tied to the token embedding), written for the pipeline as a layer list: the token embedding
(``TiedLayerSpec("embed")``), the positions, the blocks, the final LayerNorm and the tied embedding again as the
head (a ``forward_fn``, GPT-NeoX's shape). Every layer draws its initial weights from a generator seeded by its
own index, so every system and every cut starts from the same weights (``gpt.GPT`` is re-initialised alike).
Each system trains for ``--warmup`` + ``--steps`` optimizer steps of ``--gas`` micro-batches on the same data:

* ``torch``: plain PyTorch on ``gpt.GPT``: fp32 parameters, ``torch.autocast(bfloat16)``, fused AdamW, loss / GAS,
  ``clip_grad_norm_`` (one process only);
* ``ds_engine`` / ``upstream_engine``: ``deepspeed.initialize`` on ``gpt.GPT``; ``engine(x)``,
  ``engine.backward(loss)``, ``engine.step()`` per micro-batch (bf16, ZeRO stage ``--zero``, AdamW, clipping 1.0;
  one process only);
* ``ds_pipe`` / ``upstream_pipe``: the same config on a ``PipelineModule(num_stages=--pp)``; ``engine.train_batch``
  runs synchronous 1F1B (``TrainSchedule`` through ``_INSTRUCTION_MAP``);
* ``ds_pipe_il``: this package, ``"pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2}``;
* ``ds_pipe_zb``: this package, ``"pipeline": {"schedule": "zero_bubble"}`` (ZB-H1).

At ``--pp 1`` (one process) the pipelines measure what the schedule machinery costs against plain training and the
package's own engine. At ``--pp`` > 1 the script runs under ``torchrun`` with ``--pp`` x data-parallel ranks, one
system per launch (``benchmarks/pipe_bench.sh multi`` does that). The ``ds_*`` systems need this package, the
``upstream_*`` ones whichever ``deepspeed`` is imported first (upstream 0.19.8 on ``PYTHONPATH``); each process
prints ``IMPORTED <version> <file>`` first. Rank 0 prints one ``RESULT`` JSON line per system: median step time
over the timed steps, tokens/s (all data-parallel replicas), peak allocated memory per rank
(``torch.cuda.max_memory_allocated`` over the timed steps), first and last loss. ``--device cpu`` (gloo) with a
tiny model checks the script without a GPU.
"""

import argparse
import gc
import json
import math
import os
import socket
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpt.py, not the repository (upstream runs)
import gpt  # noqa: E402

PIPE_SYSTEMS = {
    "ds_pipe": "1f1b",
    "ds_pipe_il": "interleaved_1f1b",
    "ds_pipe_zb": "zero_bubble",
    "upstream_pipe": None
}


def _seeded_init(module, seed, n_layers):
    """``gpt.GPT.reset_parameters``' distributions, drawn from a generator of the layer's own seed."""
    gen = torch.Generator().manual_seed(1000 + seed)
    residual_std = 0.02 / math.sqrt(2 * n_layers)
    with torch.no_grad():
        for name, sub in module.named_modules():
            if isinstance(sub, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(".proj") else 0.02
                sub.weight.copy_(torch.randn(sub.weight.shape, generator=gen) * std)
                if getattr(sub, "bias", None) is not None:
                    sub.bias.zero_()
            elif isinstance(sub, nn.LayerNorm):
                sub.weight.fill_(1.0)
                sub.bias.zero_()
    return module


class TokenEmbedding(nn.Embedding):

    def __init__(self, cfg):
        super().__init__(cfg.vocab, cfg.d_model)
        _seeded_init(self, 0, cfg.n_layers)


class Positions(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.pos_emb = nn.Embedding(cfg.seq, cfg.d_model)
        _seeded_init(self, 1, cfg.n_layers)

    def forward(self, x):
        return x + self.pos_emb(torch.arange(x.shape[1], device=x.device))


class SeededBlock(gpt.Block):

    def __init__(self, cfg, index):
        super().__init__(cfg)
        _seeded_init(self, 2 + index, cfg.n_layers)


def head_logits(embedding, x):
    return F.linear(x, embedding.weight)


def build_gpt(cfg):
    """``gpt.GPT`` with the pipeline layers' initial weights."""
    model = gpt.GPT(cfg)
    _seeded_init(model.tok_emb, 0, cfg.n_layers)
    _seeded_init(model.pos_emb, 1, cfg.n_layers)
    for index, block in enumerate(model.blocks):
        _seeded_init(block, 2 + index, cfg.n_layers)
    return model


def build_pipeline(cfg, stages):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    specs = [TiedLayerSpec("embed", TokenEmbedding, cfg), LayerSpec(Positions, cfg)]
    specs += [LayerSpec(SeededBlock, cfg, index) for index in range(cfg.n_layers)]
    specs += [
        LayerSpec(nn.LayerNorm, cfg.d_model),
        TiedLayerSpec("embed", TokenEmbedding, cfg, forward_fn=head_logits)
    ]
    return PipelineModule(layers=specs, num_stages=stages, loss_fn=gpt.lm_loss, partition_method="type:SeededBlock")


def ds_config(args, system):
    optimizer = {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}
    if system.startswith("upstream"):
        optimizer["params"]["torch_adam"] = True  # no JIT build of upstream's fused Adam
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.gas,
        "gradient_clipping": 1.0,
        "bf16": {
            "enabled": args.device == "cuda"
        },
        "optimizer": optimizer,
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": args.zero
        },
    }
    if PIPE_SYSTEMS.get(system):
        cfg["pipeline"] = {"schedule": PIPE_SYSTEMS[system], "virtual_stages": args.virtual_stages}
    return cfg


def make_data(args, steps):
    """``steps x gas`` micro-batches of (tokens, next tokens), on the device; the same on every rank."""
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps * args.gas):
        ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=gen)
        batches.append((ids[:, :-1].to(args.device), ids[:, 1:].to(args.device)))
    return batches


def run_system(system, args, cfg, data):
    import deepspeed
    cuda = args.device == "cuda"
    distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1

    def sync():
        if cuda:
            torch.cuda.synchronize()
        if distributed:
            torch.distributed.barrier()

    engine = optimizer = model = None
    if system == "torch":
        model = build_gpt(cfg).to(args.device)
        optimizer = torch.optim.AdamW(model.parameters(),
                                      lr=1e-4,
                                      betas=(0.9, 0.95),
                                      weight_decay=0.1,
                                      fused=cuda or None)

        def step(micro_batches):
            losses = []
            for tokens, targets in micro_batches:
                with torch.autocast(args.device, dtype=torch.bfloat16, enabled=cuda):
                    out = model(tokens)
                loss = gpt.lm_loss(out, targets)
                (loss / args.gas).backward()
                losses.append(loss.detach())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return torch.stack(losses).mean()
    elif system.endswith("_engine"):
        model = build_gpt(cfg)
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               model_parameters=model.parameters(),
                                               config=ds_config(args, system))

        def step(micro_batches):
            losses = []
            for tokens, targets in micro_batches:
                loss = gpt.lm_loss(engine(tokens), targets)
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach())
            return torch.stack(losses).mean()
    else:
        model = build_pipeline(cfg, args.pp)
        # an interleaved schedule re-cuts the module at initialize: the optimizer then comes from the config alone
        params = None if system == "ds_pipe_il" else [p for p in model.parameters() if p.requires_grad]
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config(args, system))
        if type(engine).__name__ != "PipelineEngine":
            raise RuntimeError(f"deepspeed.initialize returned {type(engine).__name__}")

        def step(micro_batches):
            return engine.train_batch(iter(micro_batches))

    times, losses = [], []
    for index in range(args.warmup + args.steps):
        if index == args.warmup and cuda:
            sync()
            torch.cuda.reset_peak_memory_stats()
        micro_batches = data[index * args.gas:(index + 1) * args.gas]
        sync()
        start = time.perf_counter()
        loss = step(micro_batches)
        sync()
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
    median = statistics.median(times)
    replicas = (torch.distributed.get_world_size() // args.pp) if distributed else 1
    tokens = args.micro_batch * args.gas * args.seq * replicas
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None
    peaks = [peak]
    if distributed:
        peaks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(peaks, peak)
    result = dict(median_step_s=round(median, 5),
                  tokens_per_s=round(tokens / median, 1),
                  step_times_s=[round(t, 5) for t in times],
                  peak_mem_gib=max(peaks) if cuda else None,
                  peak_mem_gib_per_rank=peaks,
                  first_loss=round(losses[0], 5),
                  final_loss=round(losses[-1], 5))
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()
    engine = optimizer = model = step = None  # free the memory before the next system
    return result


def summarize(path):
    """A markdown table of the ``RESULT`` lines in ``path``: each system against its own package's engine (pp 1)
    or its own package's 1F1B (pp > 1), and against plain torch."""
    rows = [json.loads(line.split(" ", 1)[1]) for line in open(path) if line.startswith("RESULT ")]
    base = {(r["workload"], r["pp"], r["gas"], r["system"]): r for r in rows if r.get("ok")}
    lines = [
        "| workload | pp | GAS | system | deepspeed | median step (s) | tokens/s | vs own baseline | vs torch | "
        "peak mem max/GPU (GiB) | first loss | final loss |", "|" + " --- |" * 12
    ]
    for r in rows:
        head = f"| {r['workload']} | {r['pp']} | {r['gas']} | {r['system']} | {r['deepspeed']} |"
        if not r.get("ok"):
            lines.append(f"{head} {r.get('error', '')} |||||||")
            continue
        upstream = r["system"].startswith("upstream")
        own = ("upstream_engine" if upstream else "ds_engine") if r["pp"] == 1 else (
            "upstream_pipe" if upstream else "ds_pipe")
        own = base.get((r["workload"], r["pp"], r["gas"], own)) if r["system"] != "torch" else None
        torch_run = base.get((r["workload"], r["pp"], r["gas"], "torch"))

        def ratio(other):
            return f"{other['median_step_s'] / r['median_step_s']:.3f}x" if other and other is not r else "-"

        lines.append(f"{head} {r['median_step_s']:.4f} | {r['tokens_per_s']:.0f} | {ratio(own)} | "
                     f"{ratio(torch_run)} | {r['peak_mem_gib']} | {r['first_loss']:.4f} | {r['final_loss']:.4f} |")
    lines.append("")
    lines.append("'vs' columns: throughput relative to the baseline (above 1: faster than it).")
    return "\n".join(lines)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--summarize":
        print(summarize(sys.argv[2]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--systems",
                        default="torch,ds_engine,ds_pipe,ds_pipe_zb",
                        help="comma-separated: torch, ds_engine, ds_pipe, ds_pipe_il, ds_pipe_zb, upstream_engine, "
                        "upstream_pipe")
    parser.add_argument("--workload", default="custom", help="a label for the result lines")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (> 1: run under torchrun)")
    parser.add_argument("--virtual-stages", type=int, default=2, help="model chunks per stage (ds_pipe_il)")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--gas", type=int, default=8)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (gloo) for a check of the script")
    args = parser.parse_args()
    if "MASTER_PORT" not in os.environ:  # one process: a free port (a fixed one may be another job's)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world % args.pp:
        raise SystemExit(f"--pp {args.pp} does not divide the world of {world} ranks")
    systems = args.systems.split(",")
    if world > 1 and (len(systems) != 1 or systems[0] not in PIPE_SYSTEMS):
        raise SystemExit("under torchrun, run one pipeline system per launch (ds_pipe, ds_pipe_il, ds_pipe_zb or "
                         "upstream_pipe)")
    import deepspeed
    print(f"IMPORTED deepspeed {deepspeed.__version__} {deepspeed.__file__}", flush=True)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # a PipelineModule cuts its stages over the initialized world (one rank too: upstream's needs a group)
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    cfg = gpt.GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, vocab=args.vocab, seq=args.seq)
    data = make_data(args, args.warmup + args.steps)
    failed = False
    for system in systems:
        result = dict(system=system,
                      workload=args.workload,
                      deepspeed=deepspeed.__version__,
                      deepspeed_file=deepspeed.__file__,
                      pp=args.pp,
                      world=world,
                      d_model=args.d_model,
                      layers=args.layers,
                      seq=args.seq,
                      micro_batch=args.micro_batch,
                      gas=args.gas,
                      zero=args.zero)
        try:
            result.update(ok=True, **run_system(system, args, cfg, data))
        except Exception as err:  # noqa: BLE001 - a system that fails is reported, the others still run
            failed = True
            result.update(ok=False, error=f"{type(err).__name__}: {str(err)[:400]}")
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        if rank == 0:
            print("RESULT " + json.dumps(result), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
