# SPDX-License-Identifier: Apache-2.0
"""The host Adam op against torch's fused CPU AdamW, on one flat float32 partition.

Four variants per size, each timed over ``--steps`` steps after one warm-up step (the first step allocates the
moments): torch's fused AdamW (``torch.optim.AdamW(fused=True)``); the same followed by the bf16 copy of the
updated parameters into an upload buffer (``buffer.copy_(param)``, what an offloaded step does next); the host op;
the host op writing that bf16 copy in the same pass. Prints a table (median seconds per step, GB/s over the bytes
each variant must move: 28 bytes per element for the step, 2 more for a bf16 copy written in the same pass, 6 more
for a separate copy pass that reads the parameters again).

    python -m benchmarks.bench_cpu_adam --sizes 1e7,1e8 [--steps 5] [--threads N] [--pin]
"""

import argparse
import statistics
import time

import torch

from deepspeed.ops.adam import host_adam

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def filled(numel, seed):
    """A tensor of ``numel`` float32 values from a repeated random block (fast to make at 1e9 elements)."""
    gen = torch.Generator().manual_seed(seed)
    block = torch.randn(min(numel, 1 << 22), generator=gen)
    return block.repeat(numel // block.numel() + 1)[:numel].contiguous()


def time_steps(step, steps):
    step()  # warm-up: the first step allocates and touches the moments
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_size(numel, steps, pin):
    param = torch.nn.Parameter(filled(numel, 0))
    param.grad = filled(numel, 1).mul_(1e-2)
    upload = torch.empty(numel, dtype=torch.bfloat16, pin_memory=pin)
    rows = []

    torch_opt = torch.optim.AdamW([param], fused=True, **HYPER)
    rows.append(("torch fused AdamW", time_steps(torch_opt.step, steps), 28))

    def torch_then_copy():
        torch_opt.step()
        upload.copy_(param.detach())

    rows.append(("torch fused AdamW + bf16 copy", time_steps(torch_then_copy, steps), 34))
    torch_opt.state.clear()  # free its moments before the host op allocates its own

    op = host_adam.host_adam_op()
    if op is None:
        rows.append(("host op", float("nan"), 28))
        return rows
    group = dict(HYPER, decoupled_weight_decay=True)
    state = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
    rows.append(("host op", time_steps(lambda: host_adam.adam_step(op, group, param.data, param.grad, state),
                                       steps), 28))
    rows.append(("host op + bf16 copy (one pass)",
                 time_steps(lambda: host_adam.adam_step(op, group, param.data, param.grad, state, upload), steps), 30))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1e7,1e8", help="comma-separated element counts")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--pin", action="store_true", help="pin the bf16 upload buffer")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| elements | variant | s/step | GB/s | vs torch fused AdamW (+ copy) |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for numel in (int(float(s)) for s in args.sizes.split(",")):
        rows = bench_size(numel, args.steps, args.pin)
        base = {False: rows[0][1], True: rows[1][1]}
        for name, seconds, bytes_per_element in rows:
            ratio = base["copy" in name] / seconds
            print(
                f"| {numel:.1e} | {name} | {seconds:.4f} | {numel * bytes_per_element / seconds / 1e9:.1f} | "
                f"{ratio:.2f}x |",
                flush=True)


if __name__ == "__main__":
    main()
