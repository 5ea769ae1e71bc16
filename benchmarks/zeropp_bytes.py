# SPDX-License-Identifier: Apache-2.0
"""ZeRO++ bytes per training step, by collective and group, from the comms logger; and the step time.

A small GPT-shaped MLP stack (``--layers`` blocks of ``d -> 4d -> d``) trains under ZeRO-3 at ``--world``
ranks with each ZeRO++ setting in turn:

* ``zero3``: plain ZeRO-3;
* ``hpz``: ``zero_hpz_partition_size = --h`` (backward all-gathers inside nodes of ``h`` ranks);
* ``qwz``: ``zero_quantized_weights``; ``qgz``: ``zero_quantized_gradients``;
* ``zeropp``: all three.

For each it reports, per comms-logger record (``all_gather_into_tensor``, ``...:hpz_node``, ``...:qwZ``,
``reduce_scatter_tensor``, ``all_to_all_single:qgZ...``), the bytes rank 0 sent per step (averaged over the timed
steps) and the median step time, and checks that ``hpz`` trained bitwise like ``zero3`` (same losses).

On a machine with ``--world`` GPUs it runs NCCL; otherwise (or with ``--cpu``) gloo on CPU processes, where
the byte counts are the same and the times are CPU times. The qwZ/qgZ runs use the torch reference of the block
quantization (``DS_NATIVE_BLOCK_QUANT=0``); ``--native`` adds them with the host op (what a CPU engine uses by
default; CPU tensors only).

Command (repository root; about 1 minute on 4 CPU cores at the defaults)::

    python benchmarks/zeropp_bytes.py --cpu --world 4 --h 2

Prints one JSON object (and writes it to ``$OUT/zeropp_bytes.json`` when ``$OUT`` is set).
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time

SETTINGS = {
    "zero3": {},
    "hpz": {
        "zero_hpz_partition_size": None
    },
    "qwz": {
        "zero_quantized_weights": True
    },
    "qgz": {
        "zero_quantized_gradients": True
    },
    "zeropp": {
        "zero_hpz_partition_size": None,
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True
    },
}


def _model(args):
    import torch
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.d, 4 * args.d), torch.nn.GELU(), torch.nn.Linear(4 * args.d, args.d)]
    return torch.nn.Sequential(*layers)


def _run_setting(args, name, zero, device, native):
    import torch
    import deepspeed
    from deepspeed.comm.timed import comms_logger
    os.environ["DS_NATIVE_BLOCK_QUANT"] = "1" if native else "0"
    zero = {k: (args.h if v is None else v) for k, v in zero.items()}
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-4
            }
        },
        "bf16": {
            "enabled": device.type == "cuda"
        },
        "comms_logger": {
            "enabled": True,
            "prof_all": True
        },
        "zero_optimization": dict({
            "stage": 3,
            "stage3_param_persistence_threshold": 0
        }, **zero),
    }
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=_model(args), config=config)
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(rank)
    losses, times = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            comms_logger.comms_dict.clear()
        x = torch.randn(args.batch, args.d, generator=gen).to(device, engine.module[0].weight.dtype)
        start = time.perf_counter()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    records = {
        record: sum(size * entry[0] for size, entry in sizes.items()) / args.steps
        for record, sizes in comms_logger.comms_dict.items()
    }
    comms_logger.comms_dict.clear()
    engine.destroy()
    return {"bytes_per_step": records, "step_s": statistics.median(times[args.warmup:]), "losses": losses}


def _worker(rank, args, port, queue):
    import torch
    os.environ.update(MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port),
                      RANK=str(rank),
                      WORLD_SIZE=str(args.world),
                      LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(args.world))
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.cuda.set_device(rank)
    else:
        os.environ["DS_ACCELERATOR"] = "cpu"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    import deepspeed
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    results = {}
    for name, zero in SETTINGS.items():
        results[name] = _run_setting(args, name, zero, device, native=False)
        if args.native and name in ("qwz", "qgz", "zeropp"):
            results[name + "+native"] = _run_setting(args, name, zero, device, native=True)
    if rank == 0:
        queue.put({
            "deepspeed": deepspeed.__file__,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "results": results
        })


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--h", type=int, default=2, help="zero_hpz_partition_size of the hpz and zeropp runs")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU processes even where GPUs exist")
    parser.add_argument("--native", action="store_true", help="also time the host block-quantization op")
    args = parser.parse_args()
    import torch
    import torch.multiprocessing as mp
    if not args.cpu and torch.cuda.is_available() and torch.cuda.device_count() < args.world:
        print(f"only {torch.cuda.device_count()} GPU(s) for world {args.world}: running on CPU processes (gloo)",
              file=sys.stderr)
        args.cpu = True
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args, port, queue), nprocs=args.world, start_method="spawn")
    out = queue.get()
    out["args"] = vars(args)
    runs = out["results"]
    out["hpz_bitwise_as_zero3"] = runs["hpz"]["losses"] == runs["zero3"]["losses"]
    for run in runs.values():
        run["total_bytes_per_step"] = sum(run["bytes_per_step"].values())
        del run["losses"]
    text = json.dumps(out, indent=1, sort_keys=True)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "zeropp_bytes.json"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
