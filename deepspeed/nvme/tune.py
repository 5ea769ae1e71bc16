# SPDX-License-Identifier: Apache-2.0
"""``ds_nvme_tune``: sweep the aio settings on a folder and print the ``aio`` config section that was fastest.

    ds_nvme_tune --nvme_dir /local_nvme                     # the default grid, 400 MB per measurement
    ds_nvme_tune --nvme_dir /local_nvme --io_size 1G --sweep_config sweep.json --log_dir /tmp/tune

For every combination of ``block_size``, ``queue_depth`` and ``intra_op_parallelism`` of the grid (default
:data:`DEFAULT_SWEEP`; ``--sweep_config`` is a JSON file with the same three lists) it measures write and read
throughput of the aio handle with ``ds_io``'s method (one request of ``io_size`` bytes, O_DIRECT, the median of
``--loops`` passes), appends each result to ``{log_dir}/results.jsonl``, then prints the table, the best read and
the best write, and the ``aio`` section of the combination with the best harmonic mean of the two (NVMe offload
reads and writes about as much: an optimizer step reads and writes every page once). Several folders
(``--nvme_dir a b``, one per device of a RAID-less machine) are measured one after another; the section is chosen for
the first.

Upstream's entry points are kept: ``parse_sweep_arguments()``, ``sweep_main(args)``, ``generate_main(log_dir)``.
"""

import argparse
import itertools
import json
import os
import sys

from deepspeed.nvme.ds_io import measure, parse_size

DEFAULT_SWEEP = {
    "block_size": ["256K", "1M", "4M"],
    "queue_depth": [8, 32, 64],
    "intra_op_parallelism": [1, 2],
}
RESULTS = "results.jsonl"


def parse_sweep_arguments(argv=None):
    parser = argparse.ArgumentParser(prog="ds_nvme_tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvme_dir", nargs="+", required=True, help="writable folder(s) on the NVMe device(s)")
    parser.add_argument("--sweep_config",
                        default=None,
                        help="JSON: lists of block_size, queue_depth, "
                        "intra_op_parallelism (default: the built-in grid)")
    parser.add_argument("--no_read", action="store_true", help="skip the read measurements")
    parser.add_argument("--no_write", action="store_true", help="skip the write measurements")
    parser.add_argument("--io_size", default="400M", help="bytes per measurement (default 400M)")
    parser.add_argument("--gpu", action="store_true", help="move a GPU tensor (adds the device copy)")
    parser.add_argument("--log_dir", default="_aio_bench_logs", help="where results.jsonl goes")
    parser.add_argument("--loops", type=int, default=1, help="timed passes per measurement (default 1)")
    parser.add_argument("--backend", choices=("native", "python"), default=None, help="aio engine (default: the op)")
    parser.add_argument("--verbose", action="store_true", help="print every measurement as it completes")
    return parser.parse_args(argv)


def _grid(path):
    grid = dict(DEFAULT_SWEEP)
    if path:
        with open(path) as f:
            given = json.load(f)
        unknown = set(given) - set(grid)
        if unknown:
            raise ValueError(f"ds_nvme_tune: unknown keys in {path}: {sorted(unknown)} (known: {sorted(grid)})")
        grid.update(given)
    return [
        dict(block_size=parse_size(b), queue_depth=int(q), intra_op_parallelism=int(p))
        for b, q, p in itertools.product(grid["block_size"], grid["queue_depth"], grid["intra_op_parallelism"])
    ]


def sweep_main(args):
    """Measure every setting of the grid on every folder; results go to ``{log_dir}/results.jsonl``."""
    os.makedirs(args.log_dir, exist_ok=True)
    out = os.path.join(args.log_dir, RESULTS)
    size = parse_size(args.io_size)
    with open(out, "w") as log:
        for folder in args.nvme_dir:
            for setting in _grid(args.sweep_config):
                result = measure(folder,
                                 size,
                                 read=not args.no_read,
                                 write=not args.no_write,
                                 block_size=setting["block_size"],
                                 queue_depth=setting["queue_depth"],
                                 io_parallel=setting["intra_op_parallelism"],
                                 loops=args.loops,
                                 warmup_loops=1,
                                 gpu=args.gpu,
                                 backend=args.backend)
                result.update(setting)
                log.write(json.dumps(result) + "\n")
                log.flush()
                if args.verbose:
                    print(
                        json.dumps({
                            k: result.get(k)
                            for k in ("folder", "block_size", "queue_depth", "intra_op_parallelism", "write", "read")
                        }))
    return out


def _score(result):
    speeds = [result[d] for d in ("read", "write") if d in result]
    return len(speeds) / sum(1.0 / s for s in speeds) if speeds and all(speeds) else 0.0


def best_aio_section(results):
    """The ``aio`` section of the setting with the best harmonic mean of read and write throughput."""
    best = max(results, key=_score)
    return {
        "aio": {
            "block_size": best["block_size"],
            "queue_depth": best["queue_depth"],
            "intra_op_parallelism": best["intra_op_parallelism"],
            "single_submit": False,
            "overlap_events": True,
        }
    }


def generate_main(log_dir):
    """Print the table of ``{log_dir}/results.jsonl``, the best read and write, and the ``aio`` section to use."""
    with open(os.path.join(log_dir, RESULTS)) as f:
        results = [json.loads(line) for line in f if line.strip()]
    if not results:
        raise ValueError(f"ds_nvme_tune: no results in {log_dir}")
    first = results[0]["folder"]
    mine = [r for r in results if r["folder"] == first]
    print("| folder | block_size | queue_depth | intra_op_parallelism | write GB/s | read GB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        cells = [f"{r[d]:.2f}" if d in r else "-" for d in ("write", "read")]
        print(f"| {r['folder']} | {r['block_size']} | {r['queue_depth']} | {r['intra_op_parallelism']} | "
              f"{cells[0]} | {cells[1]} |")
    for direction in ("read", "write"):
        done = [r for r in mine if direction in r]
        if done:
            top = max(done, key=lambda r: r[direction])
            print(f"best {direction}: {top[direction]:.2f} GB/s (block_size {top['block_size']}, queue_depth "
                  f"{top['queue_depth']}, intra_op_parallelism {top['intra_op_parallelism']})")
    section = best_aio_section(mine)
    print(f"aio section for {first} (best harmonic mean of read and write):")
    print(json.dumps(section, indent=2))
    return section


def main(argv=None):
    args = parse_sweep_arguments(argv)
    print(f"Running DeepNVMe performance tuning on {args.nvme_dir}")
    try:
        sweep_main(args)
        generate_main(args.log_dir)
    except (ValueError, OSError, RuntimeError) as error:
        print(f"ds_nvme_tune: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
