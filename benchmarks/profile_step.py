# SPDX-License-Identifier: Apache-2.0
"""Where one optimizer step's time goes: a torch.profiler trace of one step per system, and its summary.

    python benchmarks/profile_step.py --systems ds_zero2,ds_zero3,ddp --d-model 512 --layers 48 --heads 8 \
        --vocab 8192 --seq 512 --micro-batch 8 --gas 2 --out-dir prof

For each system: ``--warmup`` steps, then one profiled step. Printed per system: the step's wall time, the CPU
time the host spent (the profiler's total of top-level CPU events), the device's busy time (sum of kernel times),
the ``DS::<phase>`` ranges of this package (count, total CPU ms) and the top operators by self CPU time. With
``--out-dir`` the Chrome trace of each step is written there (``<system>.json``). ``--timeline`` prints, per system,
the step's timeline: every ``DS::`` range with its thread, start and length (ms from the step's start), and the
device's busy share in 20 ms bins (where the GPU waits for the host).
"""

import argparse
import json
import os
import sys
import time

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.gpt import GPT, GPTConfig  # noqa: E402
from benchmarks.systems import make_system  # noqa: E402
from benchmarks.train_bench import SEED, init_distributed, make_data  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default="ds_zero2,ds_zero3,ddp")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--gas", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="unused (the data generator's timed steps)")
    ap.add_argument("--bucket-size", type=float, default=5e7)
    ap.add_argument("--unit-size", type=float, default=4e7)
    ap.add_argument("--ds-extra", type=json.loads, default={}, help="a JSON object merged into the DeepSpeed config")
    ap.add_argument("--zenflow",
                    type=json.loads,
                    default={},
                    help="+zenflow systems: the zenflow section (a JSON object)")
    ap.add_argument("--profile-steps", type=int, default=1, help="optimizer steps profiled together (after --warmup)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--timeline", action="store_true", help="print the DS:: ranges and the device's busy bins in time")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pg-timeout-min", type=float, default=10.0)
    args = ap.parse_args(argv)
    args.steps = args.profile_steps
    return args


def summarize(prof, wall_s, name, top):
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    ranges = sorted((e for e in events if e.key.startswith("DS::")), key=lambda e: -e.cpu_time_total)
    lines = [f"## {name}: step {wall_s * 1e3:.1f} ms wall, device busy {device_us / 1e3:.1f} ms"]
    lines.append("| DS range | calls | CPU total (ms) | device (ms) |")
    lines.append("| --- | ---: | ---: | ---: |")
    for e in ranges:
        lines.append(f"| {e.key} | {e.count} | {e.cpu_time_total / 1e3:.2f} | {e.device_time_total / 1e3:.2f} |")
    lines.append("")
    lines.append("| op (top by self CPU) | calls | self CPU (ms) | CPU total (ms) |")
    lines.append("| --- | ---: | ---: | ---: |")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        lines.append(f"| {e.key[:60]} | {e.count} | {e.self_cpu_time_total / 1e3:.2f} | "
                     f"{e.cpu_time_total / 1e3:.2f} |")
    return "\n".join(lines)


def timeline(trace_path, bin_ms=20.0):
    """The ``DS::`` ranges (thread, start, length) and the device's busy share per bin, from a Chrome trace."""
    with open(trace_path) as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    if not events:
        return "(empty trace)"
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e.get("dur", 0) for e in events)
    lines = ["| DS range | tid | start (ms) | length (ms) |", "| --- | ---: | ---: | ---: |"]
    ranges = sorted(
        (e for e in events if str(e.get("name", "")).startswith("DS::") and e.get("cat") != "gpu_user_annotation"),
        key=lambda e: e["ts"])
    merged = []  # consecutive ranges of one name on one thread closer than 1 ms: one row
    for e in ranges:
        start, end = (e["ts"] - t0) / 1e3, (e["ts"] + e.get("dur", 0) - t0) / 1e3
        last = merged[-1] if merged else None
        if last and last[0] == e["name"] and last[1] == e.get("tid") and start - last[3] < 1.0:
            last[3], last[4] = end, last[4] + 1
        else:
            merged.append([e["name"], e.get("tid"), start, end, 1])
    for name, tid, start, end, n in merged:
        lines.append(f"| {name}{f' x{n}' if n > 1 else ''} | {tid} | {start:.1f} | {end - start:.1f} |")
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    nbins = int((t1 - t0) / 1e3 / bin_ms) + 1
    busy = [0.0] * nbins
    copies = [0.0] * nbins
    for e in device:
        s, d = (e["ts"] - t0) / 1e3, e.get("dur", 0) / 1e3
        while d > 0:
            b = min(int(s / bin_ms), nbins - 1)
            part = min(d, (b + 1) * bin_ms - s)
            (copies if e.get("cat") == "gpu_memcpy" else busy)[b] += part
            s, d = s + part, d - part
    lines.append("")
    lines.append(f"device busy per {bin_ms:.0f} ms bin (kernels% / copies%):")
    row = []
    for b in range(nbins):
        row.append(f"{b * bin_ms:.0f}:{min(100, busy[b] / bin_ms * 100):.0f}/{min(100, copies[b] / bin_ms * 100):.0f}")
    for i in range(0, len(row), 10):
        lines.append("  " + "  ".join(row[i:i + 10]))
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    device = init_distributed(args)
    import deepspeed
    rank = torch.distributed.get_rank()
    if rank == 0:
        print(f"deepspeed {deepspeed.__version__} from {deepspeed.__file__}", flush=True)
    cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, vocab=args.vocab, seq=args.seq)
    data = make_data(args, rank, device)
    hp = dict(micro_batch=args.micro_batch,
              gas=args.gas,
              lr=1e-4,
              weight_decay=0.1,
              betas=(0.9, 0.95),
              clip=1.0,
              bucket_size=int(args.bucket_size),
              unit_size=int(args.unit_size),
              ds_extra=args.ds_extra,
              zenflow=args.zenflow)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name in args.systems.split(","):
        torch.manual_seed(SEED)
        with torch.device(device):
            model = GPT(cfg)
        system = make_system(name, model, hp, device)
        del model
        for micro_batches in data[:args.warmup]:
            system.step(micro_batches)
        if device.type == "cuda":
            torch.cuda.synchronize()
        zenflow = getattr(getattr(getattr(system, "engine", None), "_stage", None), "zenflow", None)
        busy = zenflow.window.busy if zenflow is not None else None
        if busy is not None:
            zenflow.window.wait()
            busy.update(accumulate_s=0.0, host_step_s=0.0)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for micro_batches in data[args.warmup:args.warmup + args.profile_steps]:
                system.step(micro_batches)
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        counts = dict(getattr(zenflow.window, "counts", {}), **getattr(zenflow, "counts", {})) if zenflow else None
        system.close()  # waits for the host worker
        if rank == 0 and busy is not None:
            print(f"ZenFlow host worker during the profiled steps (s): {busy}; counts since the start: {counts}",
                  flush=True)
        if rank == 0:
            print(summarize(prof, wall, name, args.top), flush=True)
            trace = None
            if args.out_dir:
                os.makedirs(args.out_dir, exist_ok=True)
                trace = os.path.join(args.out_dir, f"{name}.json")
            elif args.timeline:
                trace = f"/tmp/profile_step_{os.getpid()}_{name}.json"
            if trace:
                prof.export_chrome_trace(trace)
            if args.timeline:
                print(timeline(trace), flush=True)
        del system, prof
        if device.type == "cuda":
            torch.cuda.empty_cache()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
