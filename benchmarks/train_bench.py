# SPDX-License-Identifier: Apache-2.0
"""Side-by-side training benchmark: the same GPT-style decoder, data and steps under several systems, on one host.

Launch with ``torchrun --nproc_per_node N benchmarks/train_bench.py --systems ds_zero2,fsdp2,ddp --out bench.md``.
The processes run the systems one after another; before each, everything of the previous one is freed, the CUDA
cache emptied and the peak-memory counters reset. Every system starts from the same initial weights (same seed)
and sees the same micro-batches (per rank, per step), so their losses should agree to bf16 precision.

Per system: ``--warmup`` untimed optimizer steps, then ``--steps`` timed ones (each timed between
``torch.cuda.synchronize`` calls), reported as the median step time, global tokens/s
(micro-batch x GAS x world x seq / step time), MFU, the peak ``torch.cuda.max_memory_allocated`` (max over ranks)
and the first and final loss (mean over ranks). A system that raises (an OOM, say) gets its error in its row and
the others still run; a failure on some ranks only can leave the others waiting in a collective (until the
process-group timeout, ``--pg-timeout-min``).

Rank 0 prints a markdown table and JSON lines, and writes them to ``--out`` and ``<out without .md>.jsonl`` (both
rewritten after every system). Each JSON line holds the system's loss and time of every step; ``--plot FILE.png``
draws them (loss and step time per system, see ``benchmarks/plots.py``; needs matplotlib) when all systems ran.
"""

import argparse
import datetime
import gc
import json
import os
import socket
import statistics
import sys
import time

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# DS_BENCH_UPSTREAM=1: the repository root goes last on the path, so ``import deepspeed`` finds another installation
# (upstream DeepSpeed on PYTHONPATH) while ``benchmarks`` still comes from here. The run prints which it imported.
UPSTREAM = os.environ.get("DS_BENCH_UPSTREAM", "") == "1"
if _REPO_ROOT not in sys.path:
    if UPSTREAM:
        sys.path.append(_REPO_ROOT)
    else:
        sys.path.insert(0, _REPO_ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import host_rss  # noqa: E402
from benchmarks.gpt import GPT, GPTConfig, count_params, flops_per_token  # noqa: E402
from benchmarks.systems import MODIFIERS, SYSTEMS, make_system, split_name  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0
SEED = 1234
GIB = float(1 << 30)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems",
                        default="ds_zero2,fsdp2,ddp",
                        help=f"comma-separated, run in this order; any of {', '.join(SYSTEMS)}")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--bucket-size", type=float, default=5e7, help="ds_zero*: reduce_bucket_size (elements)")
    parser.add_argument("--ds-extra",
                        type=json.loads,
                        default={},
                        help="ds_zero*: a JSON object merged into the DeepSpeed config (nested keys merge), "
                        "e.g. '{\"data_types\": {\"grad_accum_dtype\": \"bf16\"}}'")
    parser.add_argument("--unit-size",
                        type=float,
                        default=4e7,
                        help="ds_zero3: stage3_prefetch_bucket_size, the size of a gather/reduce unit (elements)")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--peak-tflops",
                        type=float,
                        default=H200_BF16_DENSE_TFLOPS,
                        help="per-GPU dense bf16 peak the MFU is taken against")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--pg-timeout-min", type=float, default=10.0)
    parser.add_argument("--out", default=None, help="markdown output file (JSON lines go next to it)")
    parser.add_argument("--plot",
                        default=None,
                        metavar="FILE.png",
                        help="draw loss and step time per system into this PNG (needs matplotlib)")
    parser.add_argument("--no-pin-memory",
                        dest="pin_memory",
                        action="store_false",
                        help="+offload/+zenflow: offload sections with pin_memory false (default true)")
    parser.add_argument("--nvme-path", default=None, help="+nvme: the folder on the NVMe device (nvme_path)")
    parser.add_argument("--zenflow-topk", type=float, default=0.1, help="+zenflow: topk_ratio")
    parser.add_argument("--zenflow-update-interval", default="4", help="+zenflow: update_interval (int or auto)")
    parser.add_argument("--zenflow-select-strategy", default="auto", help="+zenflow: select_strategy")
    parser.add_argument("--zenflow-select-interval", default="auto", help="+zenflow: select_interval (int or auto)")
    parser.add_argument("--zenflow-no-overlap",
                        dest="zenflow_overlap",
                        action="store_false",
                        help="+zenflow: overlap_step false (default true)")
    parser.add_argument("--zenflow-offload", action="store_true", help="+zenflow: offload (GPU part's state on host)")
    parser.add_argument("--log-steps",
                        action="store_true",
                        help="print each step's loss and time as it ends (a run stopped early still leaves them)")
    parser.add_argument("--idle-steps",
                        type=int,
                        default=0,
                        help="after the timed steps, profile this many more and report the GPU idle fraction")
    parser.add_argument("--profile-dir",
                        default=None,
                        help="with --idle-steps: write each system's profiler table (top ops) into this folder")
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for name in args.systems:
        try:
            split_name(name)
        except ValueError as exc:
            parser.error(f"{exc} (modifiers: {', '.join(MODIFIERS)})")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def init_distributed(args):
    """Join the torchrun group (or make a group of one when started without torchrun); return this rank's device."""
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"  # this package must not pick the GPUs either
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    timeout = datetime.timedelta(minutes=args.pg_timeout_min)
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


def make_data(args, rank, device):
    """``[step][micro] -> (tokens, targets)`` for this rank: a Zipf-like unigram stream, the same for every system.

    The skewed unigram distribution gives the models something to learn within a few steps, so the losses of the
    systems can be compared while they move.
    """
    probs = 1.0 / (torch.arange(args.vocab, dtype=torch.float64) + 10.0)
    data = []
    for step in range(args.warmup + args.steps):
        micro = []
        for m in range(args.gas):
            gen = torch.Generator().manual_seed(SEED + 1_000_003 * rank + 1009 * step + m)
            seq = torch.multinomial(probs, args.micro_batch * (args.seq + 1), replacement=True, generator=gen)
            seq = seq.view(args.micro_batch, args.seq + 1).to(device)
            micro.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
        data.append(micro)
    return data


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def bench_system(name, args, cfg, data, device):
    """Build, train and time one system on this rank; no collectives after the last step. Returns local stats."""
    hp = dict(micro_batch=args.micro_batch,
              gas=args.gas,
              lr=args.lr,
              weight_decay=args.weight_decay,
              betas=(0.9, 0.95),
              clip=args.clip,
              bucket_size=int(args.bucket_size),
              unit_size=int(args.unit_size),
              ds_extra=args.ds_extra,
              pin_memory=args.pin_memory,
              nvme_path=args.nvme_path,
              zenflow=zenflow_section(args))
    torch.manual_seed(SEED)
    host_rss.reset()
    with torch.device(device):
        model = GPT(cfg)
    system = make_system(name, model, hp, device)
    del model
    gc.collect()
    setup_rss = host_rss.peak()
    sampler = host_rss.Sampler()
    # Building a system (an fp32 model on the device, then each system's own copies) has its own
    # peak; training's peak is measured separately from here on.
    setup_peak = None
    if device.type == "cuda":
        setup_peak = torch.cuda.max_memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    idle = None
    try:
        step_times, losses, grad_norms = [], [], []
        for micro_batches in data:
            _sync(device)
            start = time.perf_counter()
            loss = system.step(micro_batches)
            _sync(device)
            step_times.append(time.perf_counter() - start)
            losses.append(float(loss))
            grad_norms.append(system.grad_norm() if hasattr(system, "grad_norm") else None)
            if args.log_steps and dist.get_rank() == 0:
                print(json.dumps(dict(step_of=name, step=len(losses), loss=losses[-1], time_s=step_times[-1])),
                      flush=True)
        peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
        train_rss = sampler.stop()
        if args.idle_steps > 0:
            idle = measure_idle(name, system, data[-args.idle_steps:], device, args.profile_dir)
        # super_offload: steps speculated, kept and rolled back (with reasons), or None
        speculative = getattr(getattr(getattr(system, "engine", None), "optimizer", None), "speculative_stats", None)
        speculative = json.loads(json.dumps(speculative)) if speculative is not None else None
    finally:
        sampler.stop()
        system.close()
    return dict(step_times=step_times,
                host_rss_gib=train_rss,
                host_setup_rss_gib=setup_rss,
                losses=losses,
                grad_norms=grad_norms,
                speculative_stats=speculative,
                peak_mem_gib=peak,
                setup_peak_mem_gib=setup_peak,
                idle=idle)


def measure_idle(name, system, data, device, profile_dir):
    """Profile ``len(data)`` more steps; the GPU idle fraction is 1 - (union of device activity) / wall time.

    Device activity is every kernel, copy and memset the profiler records on the GPU (not the device-side
    copies of ``record_function`` ranges). The steps run under the
    profiler (slower on the host than unprofiled steps), so this is a measure of where the device waits, not a
    step time. With ``profile_dir`` the top operators by device and host time go to ``<system>.txt`` there.
    """
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for micro_batches in data:
            system.step(micro_batches)
        _sync(device)
        wall = time.perf_counter() - start
    # Device-side copies of record_function ranges (user annotations, the DS:: phases) are not device work.
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
                       and not getattr(e, "is_user_annotation", False) and not e.name.startswith("DS::"))
    busy, cur_start, cur_end = 0.0, None, None
    for lo, hi in intervals:
        if cur_end is None or lo > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = lo, hi
        else:
            cur_end = max(cur_end, hi)
    if cur_end is not None:
        busy += cur_end - cur_start
    span = (intervals[-1][1] - intervals[0][0]) if intervals else 0.0
    if profile_dir:
        os.makedirs(profile_dir, exist_ok=True)
        safe = name.replace("+", "_")
        with open(os.path.join(profile_dir, f"{safe}.txt"), "w") as f:
            table = prof.key_averages()
            f.write(f"{name}: {len(data)} profiled steps, wall {wall:.3f} s, device busy {busy / 1e6:.3f} s\n\n")
            f.write(table.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
            f.write("\n\n")
            f.write(table.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60))
    return dict(steps=len(data),
                wall_s=wall,
                busy_s=busy / 1e6,
                span_s=span / 1e6,
                idle_fraction=max(0.0, 1.0 - busy / 1e6 / wall) if wall > 0 else None)


def zenflow_section(args):
    """The ``zenflow`` section of ``+zenflow`` systems, from the ``--zenflow-*`` options."""

    def number_or_auto(value):
        return value if value == "auto" else int(value)

    return {
        "topk_ratio": args.zenflow_topk,
        "select_strategy": args.zenflow_select_strategy,
        "select_interval": number_or_auto(args.zenflow_select_interval),
        "update_interval": number_or_auto(args.zenflow_update_interval),
        "overlap_step": bool(args.zenflow_overlap),
        "offload": bool(args.zenflow_offload),
    }


def run_one(name, args, cfg, data, device, world):
    """Run one system on every rank and combine the ranks' stats (a dict; rank 0's view is the report)."""
    _free_memory(device)
    dist.barrier()
    base = torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None
    local, error = None, None
    try:
        local = bench_system(name, args, cfg, data, device)
    except Exception as exc:  # OOM or anything else: report it in the row, keep going
        error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    _free_memory(device)
    gathered = [None] * world
    dist.all_gather_object(gathered, (local, error))
    row = dict(system=name, base_mem_gib=base)
    errors = {r: e for r, (_, e) in enumerate(gathered) if e is not None}
    if errors:
        status = "error"
        if name == "fsdp2" and device.type == "cpu":
            status = "skipped (FSDP2 did not run on CPU/gloo)"
        if len(errors) == world and len(set(errors.values())) == 1:
            message = f"all ranks: {errors[0]}"
        else:
            message = "; ".join(f"rank {r}: {e}" for r, e in errors.items())
        row.update(status=status, error=message)
        return row
    timed = args.warmup
    n_steps = len(gathered[0][0]["losses"])
    # A step is as slow as its slowest rank; the loss is the mean over ranks.
    step_times = [max(g[0]["step_times"][i] for g in gathered) for i in range(n_steps)]
    losses = [sum(g[0]["losses"][i] for g in gathered) / world for i in range(n_steps)]
    median = statistics.median(step_times[timed:])
    tokens_per_s = args.micro_batch * args.gas * world * args.seq / median
    # grad_norms: each step's global gradient norm (rank 0's; every rank has the same)
    row.update(status="ok",
               median_step_s=median,
               step_times_s=step_times[timed:],
               warmup_times_s=step_times[:timed],
               tokens_per_s=tokens_per_s,
               setup_peak_mem_gib=max((g[0]["setup_peak_mem_gib"] or 0.0) for g in gathered) or None,
               losses=losses,
               grad_norms=gathered[0][0].get("grad_norms"),
               speculative_stats=gathered[0][0].get("speculative_stats"),
               first_loss=losses[0],
               final_loss=losses[-1])
    if device.type == "cuda":
        row["peak_mem_gib"] = max(g[0]["peak_mem_gib"] for g in gathered)
    for key in ("host_rss_gib", "host_setup_rss_gib"):  # peak resident host memory of a rank's process
        values = [g[0].get(key) for g in gathered if g[0].get(key) is not None]
        row[key] = max(values) if values else None
    idles = [g[0]["idle"] for g in gathered if g[0].get("idle")]
    if idles:
        row["gpu_idle_fraction"] = max(i["idle_fraction"] for i in idles)
        row["idle_profile"] = idles[0]
    return row


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def render(rows, header):
    """The markdown report: the header lines, then one table row per system."""
    lines = list(header) + [
        "",
        "| system | status | median step (s) | tokens/s | MFU | peak mem/rank (GiB) | setup peak (GiB) | host RSS "
        "(GiB) | GPU idle | first loss | final loss |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        status = row["status"] if row["status"] == "ok" else f"{row['status']}: {row.get('error', '')}"
        status = status.replace("|", "/")
        lines.append(f"| {row['system']} | {status} | {_fmt(row.get('median_step_s'), '.3f')} | "
                     f"{_fmt(row.get('tokens_per_s'), ',.0f')} | {_fmt(row.get('mfu'), '.1%')} | "
                     f"{_fmt(row.get('peak_mem_gib'), '.2f')} | {_fmt(row.get('setup_peak_mem_gib'), '.2f')} | "
                     f"{_fmt(row.get('host_rss_gib'), '.2f')} | {_fmt(row.get('gpu_idle_fraction'), '.1%')} | "
                     f"{_fmt(row.get('first_loss'), '.4f')} | {_fmt(row.get('final_loss'), '.4f')} |")
    return "\n".join(lines) + "\n"


def describe(args, cfg, world, device, n_params, n_matmul, fpt):
    import deepspeed
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"
    return [
        f"# train_bench: {world} x {device_name}, torch {torch.__version__}",
        "",
        f"- deepspeed: {deepspeed.__version__} from {deepspeed.__file__}",
        f"- model: GPT d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, vocab {cfg.vocab}, "
        f"seq {cfg.seq}, tied head, activation checkpointing {'on' if cfg.activation_checkpointing else 'off'}; "
        f"{n_params / 1e6:,.1f}M parameters ({n_matmul / 1e6:,.1f}M without the position embedding)",
        f"- batch: micro-batch {args.micro_batch} x GAS {args.gas} x {world} ranks x seq {args.seq} = "
        f"{args.micro_batch * args.gas * world * args.seq:,} tokens per optimizer step; bf16; AdamW lr {args.lr}, "
        f"wd {args.weight_decay}, betas (0.9, 0.95); clip {args.clip}; ds_zero* reduce_bucket_size "
        f"{int(args.bucket_size):,}",
        f"- timing: {args.warmup} warmup + {args.steps} timed optimizer steps; median of the timed steps "
        f"(each the slowest rank's); losses are means over ranks",
        f"- MFU = tokens/s / {world} ranks x (6 N + 12 L d seq) / {args.peak_tflops:g} TFLOP/s, with N = {n_matmul:,} "
        f"(all parameters but the position embedding), L = {cfg.n_layers}, d = {cfg.d_model}, seq = {cfg.seq}: "
        f"{fpt / 1e9:.2f} GFLOP per token",
        "- peak mem: torch.cuda.max_memory_allocated, max over ranks, during training (reset after the system is "
        "built); setup peak: while building it; host RSS: the peak resident memory of a rank's process during "
        "training (sampled every 20 ms; the process's peak while building the system is in the JSON, "
        "host_setup_rss_gib)",
    ]


def main(argv=None):
    args = parse_args(argv)
    device = init_distributed(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(d_model=args.d_model,
                    n_layers=args.layers,
                    n_heads=args.heads,
                    vocab=args.vocab,
                    seq=args.seq,
                    activation_checkpointing=args.activation_checkpointing)
    with torch.device("meta"):
        n_params, n_matmul = count_params(GPT(cfg))
    fpt = flops_per_token(cfg, n_matmul)
    header = describe(args, cfg, world, device, n_params, n_matmul, fpt)
    if rank == 0:
        print(f"[train_bench] {header[2].lstrip('- ')}", flush=True)
    data = make_data(args, rank, device)
    rows = []
    for name in args.systems:
        if rank == 0:
            print(f"[train_bench] {name} ...", flush=True)
        row = run_one(name, args, cfg, data, device, world)
        if row["status"] == "ok" and device.type == "cuda":
            row["mfu"] = row["tokens_per_s"] / world * fpt / (args.peak_tflops * 1e12)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
            _write(args.out, render(rows, header), rows)
    if rank == 0:
        print(render(rows, header), flush=True)
        if args.plot:
            from benchmarks.plots import plot_rows
            plot_rows(rows, args.plot, title=header[0].lstrip("# "))
            print(f"[train_bench] plot written to {args.plot}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # Only rank 0 reports failure: a nonzero exit of another rank would make torchrun kill rank 0 mid-report.
    return 1 if rank == 0 and any(r["status"] == "error" for r in rows) else 0


def _write(out, markdown, rows):
    if not out:
        return
    with open(out, "w") as f:
        f.write(markdown)
    stem = out[:-3] if out.endswith(".md") else out
    with open(stem + ".jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
