# SPDX-License-Identifier: Apache-2.0
"""Peak GPU memory of the memory keys, one case per process: ``activation_checkpointing.cpu_checkpointing`` and
``bf16.bf16_master_weights_and_grads`` + ``bf16.bf16_optimizer_states``, against a baseline with neither.

    python3 benchmarks/memory_keys_bench.py --case baseline|cpu_ckpt|bf16_masters --out results.jsonl [--tiny --cpu]

The model is ``benchmarks/gpt.py``'s GPT (default: d_model 2048, 24 layers, seq 1024, micro-batch 8; bf16, ZeRO
stage 1, AdamW on torch's kernels (``torch_adam``: upstream's FusedAdam would JIT-build), clipping 1.0). Every block
runs under ``deepspeed.checkpointing.checkpoint`` (reentrant), configured from the run's config through
``deepspeed.checkpointing.configure(None, deepspeed_config=...)`` (what upstream needs; here ``initialize`` would do
it too). ``--steps`` optimizer steps; the first allocates the optimizer state and is not measured. Measured over the
others: the peak of ``torch.cuda.max_memory_allocated`` and the memory still allocated after the last step (the
model, gradients, masters and optimizer state). ``DS_BENCH_UPSTREAM=1`` puts the repository root last on the path so
that ``import deepspeed`` finds upstream's (on ``PYTHONPATH``); each run prints the ``deepspeed`` it imported.
One JSON line per run is appended to ``--out``.
"""

import argparse
import json
import os
import socket
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.environ.get("DS_BENCH_UPSTREAM", "") == "1":
    sys.path.append(_ROOT)
else:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from benchmarks import gpt as gpt_module  # noqa: E402
from benchmarks.gpt import GPT, GPTConfig, lm_loss  # noqa: E402

CASES = ("baseline", "cpu_ckpt", "bf16_masters")


def _config(case, args):
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {
            "enabled": True
        },
        "zero_optimization": {
            "stage": args.stage,
            "reduce_bucket_size": int(5e7)
        },
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-4,
                "weight_decay": 0.1,
                "betas": [0.9, 0.95],
                "torch_adam": True
            }
        },
        "activation_checkpointing": {
            "cpu_checkpointing": case == "cpu_ckpt"
        },
    }
    if case == "bf16_masters":
        config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    return config


def _single_process_env():
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def run(case, args):
    import deepspeed

    print(f"[memory_keys_bench] case {case}: deepspeed {deepspeed.__version__} from {deepspeed.__file__}", flush=True)
    cuda = not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    _single_process_env()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")

    def ds_checkpoint(function, *inputs, use_reentrant=False):
        return deepspeed.checkpointing.checkpoint(function, *inputs)

    gpt_module.checkpoint = ds_checkpoint  # every block through deepspeed.checkpointing.checkpoint
    cfg = GPTConfig(d_model=args.d_model,
                    n_layers=args.layers,
                    n_heads=args.heads,
                    vocab=args.vocab,
                    seq=args.seq,
                    activation_checkpointing=True)
    torch.manual_seed(1234)
    with torch.device(device):  # initialised where it trains (seconds less for a billion parameters)
        model = GPT(cfg)
    config = _config(case, args)
    deepspeed.checkpointing.configure(None, deepspeed_config=config)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab, (args.steps, args.micro_batch, cfg.seq + 1), generator=gen)
    losses, times = [], []
    for step in range(args.steps):
        if step == 1 and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        batch = tokens[step].to(device)
        start = time.perf_counter()
        loss = lm_loss(engine(batch[:, :-1]), batch[:, 1:])
        engine.backward(loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    result = {
        "case": case,
        "deepspeed": deepspeed.__file__,
        "version": deepspeed.__version__,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "params": sum(p.numel() for p in model.parameters()),
        "layers": cfg.n_layers,
        "d_model": cfg.d_model,
        "seq": cfg.seq,
        "micro_batch": args.micro_batch,
        "zero_stage": args.stage,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "allocated_after_step_gib": torch.cuda.memory_allocated(device) / 2**30 if cuda else None,
        "step_s": sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0],
        "losses": losses,
    }
    engine.destroy() if hasattr(engine, "destroy") else None
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=CASES)
    parser.add_argument("--out")
    parser.add_argument("--table",
                        metavar="DIR",
                        help="instead of a run: the markdown table of DIR/ours.jsonl and DIR/upstream.jsonl, printed "
                        "and written to DIR/memory_keys.md")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (a check of the script, no memory figures)")
    parser.add_argument("--tiny", action="store_true", help="a small model (d_model 64, 2 layers, seq 32, vocab 256)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.d_model, args.layers, args.heads, args.vocab, args.seq, args.micro_batch = 64, 2, 4, 256, 32, 2
    return args


def _rows(path):
    if not os.path.exists(path):
        return {}
    with open(path) as lines:
        return {row["case"]: row for row in map(json.loads, lines) if row.get("case")}


def table(folder):
    """Markdown: per case and package, the peak and after-step memory, the saving against that package's baseline,
    the median step time and the last loss."""
    lines = [
        "| case | package | peak GiB | saved vs baseline (peak) | allocated after step GiB | saved (after step) "
        "| step s | last loss |", "| --- | --- | --- | --- | --- | --- | --- | --- |"
    ]
    device = None
    for side in ("ours", "upstream"):
        rows = _rows(os.path.join(folder, f"{side}.jsonl"))
        base = rows.get("baseline")
        for case in CASES:
            row = rows.get(case)
            if row is None:
                lines.append(f"| {case} | {side} | did not finish (see the log) | | | | | |")
                continue
            device = device or row["device"]

            def saved(key):
                if base is None or row[key] is None or base[key] is None:
                    return ""
                return f"{base[key] - row[key]:.2f}"

            def fmt(value):
                return "" if value is None else f"{value:.2f}"

            lines.append(f"| {case} | {side} {row['version']} | {fmt(row['peak_gib'])} | {saved('peak_gib')} | "
                         f"{fmt(row['allocated_after_step_gib'])} | {saved('allocated_after_step_gib')} | "
                         f"{row['step_s']:.3f} | {row['losses'][-1]:.4f} |")
    text = f"device: {device}\n\n" + "\n".join(lines) + "\n"
    with open(os.path.join(folder, "memory_keys.md"), "w") as out:
        out.write(text)
    print(text)


def main(argv=None):
    args = parse_args(argv)
    if args.table:
        table(args.table)
        return
    if args.case is None or args.out is None:
        raise SystemExit("--case and --out are required for a run")
    result = run(args.case, args)
    print(json.dumps(result), flush=True)
    with open(args.out, "a") as out:
        out.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
