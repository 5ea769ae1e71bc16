# SPDX-License-Identifier: Apache-2.0
"""What one gradient audit costs, against one forward pass of the window, on the training benchmark's GPT.

Launch with ``torchrun --nproc_per_node N benchmarks/bench_audit.py --stage 2 --out audit.md`` (defaults: the
reference workload of docs/performance.md, GPT d_model 2048, 24 layers, seq 2048, micro-batch 4, GAS 2, bf16,
AdamW, ``overlap_comm``). Every rank:

1. trains ``--warmup`` optimizer steps (kernels warm, optimizer state allocated);
2. runs the next window's forward and backward passes, and stops before ``step()``;
3. times ``--repeats`` forward passes of the window (``loss_fn`` on each micro-batch under ``torch.no_grad``, as
   the audit evaluates it) and ``--repeats`` audits with ``--directions`` directions (each between
   ``torch.cuda.synchronize`` calls; a run counts as long as its slowest rank), and the peak memory an audit adds
   (``torch.cuda.max_memory_allocated`` during the audit, minus what was allocated before it);
4. audits the same gradient doubled (the local gradient pieces times 2, then halved back, both exact): the
   relative error a factor-2 error gives on this model, beside the true gradient's;
5. steps and exits.

Rank 0 prints a markdown table and a JSON line, and writes them to ``--out`` and ``<out without .md>.jsonl``.
"""

import argparse
import json
import os
import statistics
import sys
import time

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.gpt import GPT, GPTConfig, count_params, lm_loss  # noqa: E402
from benchmarks.systems import DeepSpeedSystem  # noqa: E402
from benchmarks.train_bench import SEED, init_distributed, make_data  # noqa: E402

GIB = float(1 << 30)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--directions", type=int, default=4)
    parser.add_argument("--bucket-size", type=float, default=2.5e7)
    parser.add_argument("--unit-size", type=float, default=4e7)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--pg-timeout-min", type=float, default=10.0)
    parser.add_argument("--out", default=None, help="markdown output file (a JSON line goes next to it)")
    args = parser.parse_args(argv)
    args.steps = 1  # make_data: the warm-up windows and one measured window
    if args.repeats < 1 or args.directions < 1:
        parser.error("--repeats and --directions must be at least 1")
    return args


def window_loss_fn(engine, batch):
    tokens, targets = batch
    return lm_loss(engine(tokens), targets)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds, device):
    """The slowest rank's time (a collective)."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def timed(fn, device):
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return _slowest(time.perf_counter() - start, device), result


def scale_local_grads(engine, factor):
    stage = engine._stage
    stage.finish_window()
    with torch.no_grad():
        for param in stage.params:
            _, length = stage.local_range(param)
            stage.local_grad(param).reshape(-1)[:length].mul_(factor)


def measure(args, data, device):
    hp = dict(micro_batch=args.micro_batch,
              gas=args.gas,
              lr=1e-4,
              weight_decay=0.1,
              betas=(0.9, 0.95),
              clip=1.0,
              bucket_size=int(args.bucket_size),
              unit_size=int(args.unit_size))
    cfg = GPTConfig(d_model=args.d_model,
                    n_layers=args.layers,
                    n_heads=args.heads,
                    vocab=args.vocab,
                    seq=args.seq,
                    activation_checkpointing=args.activation_checkpointing)
    torch.manual_seed(SEED)
    with torch.device(device):
        model = GPT(cfg)
    system = DeepSpeedSystem(args.stage, model, hp)
    del model
    engine = system.engine
    try:
        for micro_batches in data[:args.warmup]:
            system.step(micro_batches)
        window = data[args.warmup]
        for tokens, targets in window:
            engine.backward(lm_loss(engine(tokens), targets))
            if not engine.is_gradient_accumulation_boundary():
                engine.step()

        def forward_window():
            with torch.no_grad():
                return sum(float(window_loss_fn(engine, b)) for b in window)

        forward_times = [timed(forward_window, device)[0] for _ in range(args.repeats)]
        audit_times, reports, extra_mem = [], [], []
        for _ in range(args.repeats):
            base = 0.0
            if device.type == "cuda":
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            seconds, report = timed(
                lambda: engine.audit_gradients(window_loss_fn, window, directions=args.directions, seed=7), device)
            if device.type == "cuda":
                extra_mem.append((torch.cuda.max_memory_allocated(device) - base) / GIB)
            audit_times.append(seconds)
            reports.append(report)
        scale_local_grads(engine, 2.0)
        doubled = engine.audit_gradients(window_loss_fn, window, directions=args.directions, seed=7)
        scale_local_grads(engine, 0.5)
        engine.step()
    finally:
        system.close()
    report = reports[0]
    forward = statistics.median(forward_times)
    audit = statistics.median(audit_times)
    return dict(stage=args.stage,
                window_forward_s=forward,
                audit_s=audit,
                ratio=audit / forward,
                window_evaluations=report.window_evaluations,
                directions=args.directions,
                extra_peak_mem_gib=max(extra_mem) if extra_mem else None,
                true_max_rel_error=report.max_rel_error,
                true_ok=report.ok,
                doubled_max_rel_error=doubled.max_rel_error,
                doubled_ok=doubled.ok,
                tolerance=report.tolerance,
                forward_times_s=forward_times,
                audit_times_s=audit_times)


def render(row, args, world, device, n_params):
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"
    mem = "-" if row["extra_peak_mem_gib"] is None else f"{row['extra_peak_mem_gib']:.2f}"
    lines = [
        f"# bench_audit: {world} x {device_name}, torch {torch.__version__}",
        "",
        f"- model: GPT d_model {args.d_model}, {args.layers} layers, seq {args.seq}, vocab {args.vocab} "
        f"({n_params / 1e6:,.1f}M parameters); micro-batch {args.micro_batch}, GAS {args.gas}, bf16, ZeRO stage "
        f"{args.stage}; medians of {args.repeats} runs (each the slowest rank's)",
        "",
        "| stage | window forward (s) | audit (s) | audit / forward | window evaluations | extra peak mem/rank (GiB) "
        "| max rel. error, true gradient | max rel. error, gradient x2 | tolerance |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {row['stage']} | {row['window_forward_s']:.3f} | {row['audit_s']:.3f} | {row['ratio']:.2f} | "
        f"{row['window_evaluations']} ({row['directions']} directions) | {mem} | {row['true_max_rel_error']:.3g} | "
        f"{row['doubled_max_rel_error']:.3g} | {row['tolerance']:g} |",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    device = init_distributed(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = make_data(args, rank, device)
    with torch.device("meta"):
        n_params, _ = count_params(
            GPT(
                GPTConfig(d_model=args.d_model,
                          n_layers=args.layers,
                          n_heads=args.heads,
                          vocab=args.vocab,
                          seq=args.seq)))
    row = measure(args, data, device)
    if rank == 0:
        markdown = render(row, args, world, device, n_params)
        print(markdown, flush=True)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(markdown)
            stem = args.out[:-3] if args.out.endswith(".md") else args.out
            with open(stem + ".jsonl", "w") as f:
                f.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
