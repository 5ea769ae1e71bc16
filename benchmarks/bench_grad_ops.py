# SPDX-License-Identifier: Apache-2.0
"""Each ``csrc/grad_ops`` kernel against the torch function it replaces
(``deepspeed.runtime.zero.gradients.grad_ops``).

Three tables:

1. **bandwidth**: few large tensors (``--elems`` elements in all, 8 tensors): time per call and GB/s over the
   bytes the pass must move (each input read once, each output written once), against the device-to-device
   copy bandwidth measured first in the same run;
2. **many small tensors**: ``--small-count`` tensors of about ``--small-elems`` elements each, where launches and
   host work dominate: time per call;
3. **launch-bound model**: the passes one optimizer step of a small GPT (``--d-model``, ``--layers``; many small
   parameters) makes under ZeRO-2 and ZeRO-3 with bf16 parameters and fp32 gradient accumulation, GAS 2, next
   to the model's forward+backward time: the step-time change the kernels would bring.

Each time is the median over ``--repeats`` rounds of ``--iters`` back-to-back calls, host clock around a
synchronised round (launch cost and host work included, as in training).

    python -m benchmarks.bench_grad_ops [--elems 134217728] [--json out.json]

``--device cpu`` runs the script with small sizes on the CPU (the wrappers then fall back to torch): a dry run of
the script, not a measurement.
"""

import argparse
import json
import statistics
import time

import torch

from deepspeed.ops import grad_ops_native as native
from deepspeed.runtime.zero.gradients import grad_ops

DEVICE = "cuda"
COEF = 0.999  # scales applied again and again must not drive the data to zero


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, iters, repeats):
    """Median seconds per call of ``fn`` over ``repeats`` rounds of ``iters`` calls."""
    fn()
    sync()
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        rounds.append((time.perf_counter() - start) / iters)
    return statistics.median(rounds)


def copy_bandwidth(elems, iters, repeats):
    src = torch.randn(elems, device=DEVICE)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), iters, repeats)
    return 2 * 4 * elems / seconds / 1e9


def split(total, count, gen):
    """``count`` sizes summing to about ``total``, uneven and mostly not multiples of 8."""
    weights = torch.rand(count, generator=gen) + 0.5
    sizes = (weights / weights.sum() * total).long().tolist()
    return [max(1, s | 1) for s in sizes]


def tensors(sizes, dtype, gen):
    return [torch.randn(n, generator=gen).to(device=DEVICE, dtype=dtype) for n in sizes]


def cases(sizes, gen):
    """(name, bytes moved, make(impl) -> callable) for every function, on tensors of ``sizes``."""
    n = sum(sizes)
    grads = tensors(sizes, torch.bfloat16, gen)
    targets = tensors(sizes, torch.float32, gen)
    flat = torch.empty(n + 7, device=DEVICE)
    world = 8
    rows = torch.empty(world, sum(-(-s // world) for s in sizes), device=DEVICE)
    parts = tensors(sizes, torch.float32, gen)
    params = tensors(sizes, torch.bfloat16, gen)
    gather = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    coef = torch.tensor(COEF, device=DEVICE)

    def fn(impl, name):
        return impl[name]

    return [
        ("scale_accumulate fp32<-bf16", n * 10, lambda i: lambda: fn(i, "scale_accumulate")(targets, grads, 0.5)),
        ("flatten_into fp32<-bf16", n * 6, lambda i: lambda: fn(i, "flatten_into")(grads, flat, 0.5, False)),
        ("flatten_into fp32<-bf16 acc", n * 10, lambda i: lambda: fn(i, "flatten_into")(grads, flat, 0.5, True)),
        ("chunk_into W=8 fp32<-bf16", n * 6, lambda i: lambda: fn(i, "chunk_into")(grads, rows, 0.5, False)),
        ("partial_sq_norm fp32", n * 4, lambda i: lambda: fn(i, "partial_sq_norm")(parts)),
        ("partial_sq_norm + unscale fp32", n * 8, lambda i: lambda: fn(i, "partial_sq_norm")(parts, None, coef)),
        ("scale_ fp32", n * 8, lambda i: lambda: fn(i, "scale_")(parts, coef)),
        ("cast_copy bf16<-fp32", n * 6, lambda i: lambda: fn(i, "cast_copy")(params, parts)),
        ("pack_cast bf16<-fp32", n * 6, lambda i: lambda: fn(i, "pack_cast")(parts, gather)),
    ]


def compare(sizes, iters, repeats, gen, copy_gbs=None):
    torch_impl = grad_ops._TORCH  # partial_sq_norm with unscale: scale_, then the norm
    rows = []
    for name, nbytes, make in cases(sizes, gen):
        t_torch = timed(make(torch_impl), iters, repeats)
        t_native = timed(make(native.WRAPPERS), iters, repeats)
        rows.append({
            "function": name,
            "torch_us": t_torch * 1e6,
            "native_us": t_native * 1e6,
            "speedup": t_torch / t_native,
            "torch_gbs": nbytes / t_torch / 1e9,
            "native_gbs": nbytes / t_native / 1e9,
            "native_of_copy": (nbytes / t_native / 1e9) / copy_gbs if copy_gbs else None,
        })
    return rows


def print_table(title, rows, with_bandwidth):
    print(f"\n### {title}\n")
    if with_bandwidth:
        print("| function | torch (us) | native (us) | speedup | torch GB/s | native GB/s | native / copy |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['function']} | {r['torch_us']:.1f} | {r['native_us']:.1f} | {r['speedup']:.2f}x | "
                  f"{r['torch_gbs']:.0f} | {r['native_gbs']:.0f} | {r['native_of_copy']:.0%} |")
    else:
        print("| function | torch (us) | native (us) | speedup |")
        print("| --- | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['function']} | {r['torch_us']:.1f} | {r['native_us']:.1f} | {r['speedup']:.2f}x |")


# -- the launch-bound model --------------------------------------------------------------------------------


def model_step(args):
    """Forward+backward time of the small GPT, and the grad_ops passes of one ZeRO-2 / ZeRO-3 step."""
    from benchmarks.gpt import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, vocab=args.vocab, seq=args.seq)
    model = GPT(cfg).to(device=DEVICE, dtype=torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]  # once each: the head is tied
    tokens = torch.randint(0, cfg.vocab, (args.micro_batch, cfg.seq), device=DEVICE)

    def fwd_bwd():
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        for p in params:
            p.grad = None

    t_fwd_bwd = timed(fwd_bwd, 3, args.repeats)
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    grads = [p.grad for p in params]
    sizes = [p.numel() for p in params]
    n = sum(sizes)
    bucket = torch.empty(n, device=DEVICE)
    partition = torch.randn(n, device=DEVICE)
    views = list(torch.split(partition, sizes))
    shaped = [v.view_as(p) for v, p in zip(views, params)]
    coef = torch.tensor(COEF, device=DEVICE)
    # ZeRO-3: one unit per block (and one for the rest), rank-major rows for a world of 2, per-unit gathers.
    units = [list(block.parameters()) for block in model.blocks]
    in_blocks = {id(p) for unit in units for p in unit}
    units.append([p for p in params if id(p) not in in_blocks])
    world = 2
    unit_grads = [[p.grad for p in unit] for unit in units]
    unit_rows = [torch.empty(world, sum(-(-p.numel() // world) for p in unit), device=DEVICE) for unit in units]
    unit_masters = [[torch.randn(p.numel(), device=DEVICE) for p in unit] for unit in units]
    unit_gather = [torch.empty(sum(p.numel() for p in unit), dtype=torch.bfloat16, device=DEVICE) for unit in units]
    param_data = [p.data for p in params]

    def zero2(impl):

        def step():
            for micro in range(args.gas):
                impl["flatten_into"](grads, bucket, 1.0 / args.gas, micro > 0)
            impl["partial_sq_norm"]([partition], None, None)
            impl["scale_"]([partition], coef)
            impl["cast_copy"](param_data, shaped)

        return step

    def zero3(impl):

        def step():
            for micro in range(args.gas):
                for g, r in zip(unit_grads, unit_rows):
                    impl["chunk_into"](g, r, 1.0 / args.gas, micro > 0)
            impl["partial_sq_norm"]([r for r in unit_rows], None, None)
            impl["scale_"](unit_rows, coef)
            for _ in range(2 * args.gas):  # a gather per forward and per backward of every micro-step
                for masters, out in zip(unit_masters, unit_gather):
                    impl["pack_cast"](masters, out)

        return step

    torch_impl = grad_ops._TORCH
    result = {"params": n, "tensors": len(params), "fwd_bwd_ms": t_fwd_bwd * 1e3, "gas": args.gas}
    for name, build in (("zero2", zero2), ("zero3", zero3)):
        t_torch = timed(build(torch_impl), 5, args.repeats)
        t_native = timed(build(native.WRAPPERS), 5, args.repeats)
        step_torch = args.gas * t_fwd_bwd + t_torch
        step_native = args.gas * t_fwd_bwd + t_native
        result[name] = {
            "torch_ms": t_torch * 1e3,
            "native_ms": t_native * 1e3,
            "step_torch_ms": step_torch * 1e3,
            "step_native_ms": step_native * 1e3,
            "step_change": step_native / step_torch - 1.0,
        }
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elems", type=int, default=1 << 27, help="elements in all, bandwidth table")
    parser.add_argument("--small-count", type=int, default=2000)
    parser.add_argument("--small-elems", type=int, default=4000)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=257)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write every number here")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the script")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":
        args.elems, args.small_count, args.small_elems, args.iters, args.repeats = 1 << 16, 50, 100, 2, 2
        args.d_model, args.layers, args.vocab, args.seq, args.micro_batch = 32, 2, 64, 17, 2
    elif native.load() is None:
        raise SystemExit("the grad_ops op is not available here (needs CUDA and nvcc)")
    gen = torch.Generator().manual_seed(0)
    name = torch.cuda.get_device_properties(0).name if DEVICE == "cuda" else "CPU (dry run)"
    copy_gbs = copy_bandwidth(1 << (28 if DEVICE == "cuda" else 16), args.iters, args.repeats)
    print(f"{name}, torch {torch.__version__}; device-to-device copy {copy_gbs:.0f} GB/s (read + write)")
    large = compare(split(args.elems, 8, gen), args.iters, args.repeats, gen, copy_gbs)
    print_table(f"bandwidth: 8 tensors, {args.elems:.3g} elements", large, True)
    small = compare(split(args.small_count * args.small_elems, args.small_count, gen), args.iters, args.repeats, gen)
    print_table(f"many small tensors: {args.small_count} tensors, ~{args.small_elems} elements each", small, False)
    model = model_step(args)
    print(f"\n### launch-bound model: GPT d_model {args.d_model}, {args.layers} layers ({model['params'] / 1e6:.1f}M "
          f"parameters in {model['tensors']} tensors), micro-batch {args.micro_batch}, GAS {args.gas}, bf16\n")
    print(f"forward+backward: {model['fwd_bwd_ms']:.2f} ms per micro-step\n")
    print("| stage | grad_ops torch (ms) | grad_ops native (ms) | step torch (ms) | step native (ms) | step change |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for stage in ("zero2", "zero3"):
        r = model[stage]
        print(f"| {stage} | {r['torch_ms']:.3f} | {r['native_ms']:.3f} | {r['step_torch_ms']:.2f} | "
              f"{r['step_native_ms']:.2f} | {r['step_change']:+.1%} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"copy_gbs": copy_gbs, "large": large, "small": small, "model": model}, handle, indent=1)


if __name__ == "__main__":
    main()
