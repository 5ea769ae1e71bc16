# SPDX-License-Identifier: Apache-2.0
"""``ds_io``: read and write throughput of the aio handle on a folder (upstream's command, this package's op).

    ds_io --folder /local_nvme --io_size 1G                          # write, then read, 1 GB
    ds_io --folder /local_nvme --io_size 1G --read --block_size 1M --queue_depth 32 --io_parallel 2

Each loop moves ``io_size`` bytes between one aligned host buffer (page-locked where a GPU is) and one file in the
folder with a single request (cut into ``block_size`` blocks, ``queue_depth * io_parallel`` of them in flight); the
file is opened with O_DIRECT, so the page cache is not measured. A write loop is ``sync_pwrite``; a read loop reads
a file written first. ``--gpu`` adds the copy to or from a device tensor. Speeds are in GB/s (1e9 bytes per second):
the median of ``--loops`` timed loops after ``--warmup_loops``; ``--json`` prints one JSON line per direction too.
The file is removed at the end.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

from deepspeed.ops.aio.async_io import aio_handle
from deepspeed.ops.aio.buffers import aligned_empty

_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text):
    """``"1G"`` -> 1073741824; ``"4096"`` -> 4096 (K, M, G, T are powers of 1024)."""
    text = str(text).strip().upper().rstrip("B")
    if text and text[-1] in _SUFFIXES:
        return int(float(text[:-1]) * _SUFFIXES[text[-1]])
    return int(float(text))


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(prog="ds_io", description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", required=True, help="a writable folder on the device to measure")
    parser.add_argument("--io_size", required=True, help="bytes per loop (K, M, G suffixes)")
    parser.add_argument("--read", action="store_true", help="measure reads only (default: writes, then reads)")
    parser.add_argument("--write", action="store_true", help="measure writes only")
    parser.add_argument("--block_size", default="1M", help="aio block size (default 1M)")
    parser.add_argument("--queue_depth", type=int, default=32, help="requests in flight per lane (default 32)")
    parser.add_argument("--io_parallel", type=int, default=1, help="intra_op_parallelism (default 1)")
    parser.add_argument("--single_submit", action="store_true", help="aio single_submit (kept for upstream's CLI)")
    parser.add_argument("--sequential_requests", action="store_true", help="aio overlap_events off (upstream's CLI)")
    parser.add_argument("--loops", type=int, default=3, help="timed loops per direction (default 3)")
    parser.add_argument("--warmup_loops", type=int, default=1, help="untimed loops first (default 1)")
    parser.add_argument("--validate", action="store_true", help="compare the file with the buffer after each loop")
    parser.add_argument("--gpu", action="store_true", help="move a GPU tensor (adds the device copy)")
    parser.add_argument("--backend",
                        choices=("native", "python"),
                        default=None,
                        help="the compiled op or Python threads (default: the op where it loads)")
    parser.add_argument("--json", action="store_true", help="print one JSON line per direction")
    return parser.parse_args(argv)


def measure(folder,
            io_size,
            *,
            read=True,
            write=True,
            block_size=1 << 20,
            queue_depth=32,
            io_parallel=1,
            single_submit=False,
            overlap_events=True,
            loops=3,
            warmup_loops=1,
            validate=False,
            gpu=False,
            backend=None):
    """Throughput of the aio handle on ``folder``: ``{"write": GB/s, "read": GB/s, ...}`` for what was asked."""
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"ds_io: {folder} is not a writable folder")
    handle = aio_handle(block_size, queue_depth, single_submit, overlap_events, io_parallel, backend=backend)
    buffer = aligned_empty(io_size, torch.uint8)
    buffer.random_(0, 256)
    device = None
    if gpu:
        if not torch.cuda.is_available():
            raise ValueError("ds_io --gpu needs a GPU")
        device = buffer.to("cuda")
    path = os.path.join(folder, f"ds_io_{os.getpid()}.bin")
    result = {
        "folder": folder,
        "io_size": io_size,
        "block_size": block_size,
        "queue_depth": queue_depth,
        "io_parallel": io_parallel,
        "backend": handle.backend,
        "gpu": bool(gpu)
    }

    def once(writing):
        start = time.perf_counter()
        if device is not None and writing:
            buffer.copy_(device)
        if writing:
            handle.sync_pwrite(buffer, path)
        else:
            handle.sync_pread(buffer, path)
        if device is not None and not writing:
            device.copy_(buffer)
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if validate:
            with open(path, "rb") as f:
                if f.read() != buffer.numpy().tobytes():
                    raise RuntimeError(
                        f"ds_io: {path} differs from the buffer after a {'write' if writing else 'read'}")
        return elapsed

    try:
        directions = [d for d, wanted in (("write", write), ("read", read)) if wanted]
        if "read" in directions and "write" not in directions:
            handle.sync_pwrite(buffer, path)  # the file the reads read
        for direction in directions:
            writing = direction == "write"
            for _ in range(warmup_loops):
                once(writing)
            times = [once(writing) for _ in range(max(1, loops))]
            result[direction] = io_size / statistics.median(times) / 1e9
            result[f"{direction}_seconds"] = times
        result["direct_refused"] = handle.direct_refused()
    finally:
        handle.close()
        if os.path.exists(path):
            os.remove(path)
    return result


def ds_io_main(argv=None):
    args = parse_arguments(argv)
    write_only, read_only = args.write and not args.read, args.read and not args.write
    try:
        result = measure(args.folder,
                         parse_size(args.io_size),
                         read=not write_only,
                         write=not read_only,
                         block_size=parse_size(args.block_size),
                         queue_depth=args.queue_depth,
                         io_parallel=args.io_parallel,
                         single_submit=args.single_submit,
                         overlap_events=not args.sequential_requests,
                         loops=args.loops,
                         warmup_loops=args.warmup_loops,
                         validate=args.validate,
                         gpu=args.gpu,
                         backend=args.backend)
    except (ValueError, OSError, RuntimeError) as error:
        print(f"ds_io: {error}", file=sys.stderr)
        return 2
    setting = (f"block_size {args.block_size}, queue_depth {args.queue_depth}, io_parallel {args.io_parallel}, "
               f"{result['backend']} engine")
    for direction in ("write", "read"):
        if direction in result:
            print(
                f"{direction.capitalize():5s} speed: {result[direction]:.2f} GB/s ({parse_size(args.io_size)} bytes, "
                f"{setting}{', GPU tensor' if args.gpu else ''})")
    if result.get("direct_refused"):
        print(f"note: {args.folder} refused O_DIRECT; the page cache was measured too")
    if args.json:
        print(json.dumps(result))
    return 0


def main(argv=None):
    """The ``ds_io`` command (its exit status)."""
    return ds_io_main(argv)


if __name__ == "__main__":
    sys.exit(main())
