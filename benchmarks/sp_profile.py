# SPDX-License-Identifier: Apache-2.0
"""Where a long-sequence step's time goes (torch.profiler), this package with and without the tiled layers.

    python3 benchmarks/sp_profile.py --layers 2 --seq 131072

Builds sp_bench.py's model and engine (this package, ``--layers`` decoder layers), runs a warm-up step, then one
profiled step per configuration, and prints the operations with the most device time and the step's wall time.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                   ("MASTER_PORT", "29517")):
    os.environ.setdefault(key, value)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--rows", type=int, default=14)
    parser.add_argument("--configs", default="tiled,untiled")
    parser.add_argument("--tiny", action="store_true", help="sp_bench's toy model on the CPU (a smoke test)")
    cli = parser.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile
    import sp_bench
    for config in cli.configs.split(","):
        args = argparse.Namespace(tiny=cli.tiny, tied=False, layers=cli.layers, start=cli.seq, cpu=cli.tiny,
                                  no_tiled_layers=config == "untiled", layer_tile=8192, no_recompute_norms=False,
                                  logits_tile=8192 if not cli.tiny else 64)
        device = sp_bench._device(args)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        engine, model, ulysses = sp_bench._build(args, "ours")
        vocab = sp_bench._shape(args)["vocab_size"]
        sp_bench._step(engine, model, ulysses, cli.seq, args.logits_tile, vocab)  # warm-up
        sp_bench._sync(device)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            sp_bench._step(engine, model, ulysses, cli.seq, args.logits_tile, vocab)
            sp_bench._sync(device)
            wall = time.perf_counter() - start
        print(f"== {config}: {cli.layers} layers, {cli.seq} tokens, step {wall:.2f} s (profiled)", flush=True)
        print(prof.key_averages().table(sort_by=sort, row_limit=cli.rows), flush=True)
        engine.destroy()
        del engine, model
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
