# SPDX-License-Identifier: Apache-2.0
"""Where a synchronous ``save_checkpoint`` spends its time, on the CPU: this package's or upstream's.

    python3 benchmarks/checkpoint_profile.py [--repeats 3] [--dir /var/tmp/ckpt_profile] [--profile] [--no-bf16]
    cd /tmp && DS_BENCH_UPSTREAM=1 DS_ACCELERATOR=cpu /path/to/upstream/python <repo>/benchmarks/checkpoint_profile.py

The model and config are ``checkpoint_bench.py``'s (GPT d_model 1024, 12 layers, seq 1024, ZeRO stage 1 on one
rank, AdamW, bf16 unless ``--no-bf16``, the default writer), trained one short step on the CPU so that the optimizer
has its moments. Each repeat saves a new tag and times the call; the files are listed (name, bytes) and removed
after each repeat. Per save, the seconds spent in a few named phases are measured by wrapping the functions that do
them (``torch.save`` whole, ``os.fsync``, file ``write`` calls, tensor copies, ``all_gather_object``); with
``--profile`` one more save runs under cProfile and its top functions are printed.

Prints one JSON line (and appends it to ``--out``): the per-save seconds, their median, the phases and the files.
"""

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import time

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UPSTREAM = os.environ.get("DS_BENCH_UPSTREAM", "") == "1"
if _REPO_ROOT not in sys.path:
    if UPSTREAM:
        sys.path.append(_REPO_ROOT)
    else:
        sys.path.insert(0, _REPO_ROOT)

import torch  # noqa: E402

from benchmarks.checkpoint_bench import ds_config  # noqa: E402
from benchmarks.gpt import GPT, GPTConfig, lm_loss  # noqa: E402


class Phases:
    """Seconds and calls per named phase, by wrapping functions (outermost call only, per phase)."""

    def __init__(self):
        self.seconds = {}
        self.calls = {}
        self.bytes = {}
        self._depth = {}
        self._undo = []

    def wrap(self, owner, attr, phase, count_bytes=None):
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            depth = self._depth.get(phase, 0)
            self._depth[phase] = depth + 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth[phase] = depth
                if depth == 0:
                    self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
                    self.calls[phase] = self.calls.get(phase, 0) + 1
                    if count_bytes is not None:
                        self.bytes[phase] = self.bytes.get(phase, 0) + count_bytes(args, kwargs)

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    def reset(self):
        self.seconds, self.calls, self.bytes = {}, {}, {}

    def report(self):
        return {
            k: dict(s=round(v, 3), calls=self.calls[k], **({
                "bytes": self.bytes[k]
            } if k in self.bytes else {}))
            for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])
        }


def _nbytes(args, kwargs):
    data = args[1] if len(args) > 1 else args[0]
    try:
        return memoryview(data).nbytes
    except TypeError:
        return 0


def _tensor_bytes(args, kwargs):
    return args[0].numel() * args[0].element_size() if torch.is_tensor(args[0]) else 0


def install_phases(phases):
    phases.wrap(torch, "save", "torch.save")
    phases.wrap(os, "fsync", "os.fsync")
    phases.wrap(os, "replace", "os.replace")
    phases.wrap(os, "rename", "os.rename")
    phases.wrap(torch.Tensor, "clone", "tensor.clone", _tensor_bytes)
    phases.wrap(torch.Tensor, "contiguous", "tensor.contiguous", _tensor_bytes)
    phases.wrap(torch.Tensor, "cpu", "tensor.cpu", _tensor_bytes)
    phases.wrap(torch.Tensor, "to", "tensor.to", _tensor_bytes)
    phases.wrap(torch.Tensor, "copy_", "tensor.copy_", _tensor_bytes)
    import deepspeed.comm as dist
    for name in ("all_gather_object", "barrier", "broadcast_object_list"):
        if hasattr(dist, name):
            phases.wrap(dist, name, f"dist.{name}")
    if not UPSTREAM:
        from deepspeed.runtime.checkpoint_engine import file_writers
        phases.wrap(file_writers.PythonFileWriter, "write", "file.write", _nbytes)
        phases.wrap(file_writers.PythonFileWriter, "close", "file.close(flush+fsync)")
        from deepspeed.runtime.checkpoint import saving, model_state, completeness
        phases.wrap(saving, "_write_files", "_write_files (build+write)")
        phases.wrap(model_state, "build_model_states", "build_model_states")
        phases.wrap(completeness, "write_mark", "completeness mark")
        phases.wrap(saving, "_copy_recovery_script", "zero_to_fp32.py copy")
        from deepspeed.runtime.zero.checkpoint import partitioned
        phases.wrap(partitioned.PartitionedCheckpoint, "checkpoint_files", "checkpoint_files (build)")
    else:
        import deepspeed.runtime.engine as eng
        for name in ("_save_checkpoint", "_save_zero_checkpoint", "_copy_recovery_script", "module_state_dict"):
            if hasattr(eng.DeepSpeedEngine, name):
                phases.wrap(eng.DeepSpeedEngine, name, f"engine.{name}")
        from deepspeed.runtime.zero import stage_1_and_2
        phases.wrap(stage_1_and_2.DeepSpeedZeroOptimizer, "state_dict", "zero.state_dict")


def _env():
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000)),
                       ("CROSS_RANK", "0"), ("CROSS_SIZE", "1"), ("LOCAL_SIZE", "1")):
        os.environ.setdefault(key, value)


def _files(directory):
    out = []
    for root, _, names in os.walk(directory):
        for name in sorted(names):
            path = os.path.join(root, name)
            out.append((os.path.relpath(path, directory), os.path.getsize(path)))
    return sorted(out)


def run(args):
    _env()
    import deepspeed
    print(f"deepspeed {deepspeed.__version__} from {deepspeed.__file__}", flush=True)
    cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.d_model // 64, seq=args.seq)
    torch.manual_seed(1234)
    model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    ds_cfg = ds_config(1, bf16=not args.no_bf16)
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)[0]
    tokens = torch.randint(0, cfg.vocab, (1, args.tokens + 1), generator=torch.Generator().manual_seed(0))
    loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    phases = Phases()
    install_phases(phases)
    root = os.path.join(args.dir, "upstream" if UPSTREAM else "ours")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    saves = []
    files = None
    for index in range(args.repeats + (1 if args.profile else 0)):
        profile = args.profile and index == args.repeats
        os.sync()  # earlier dirty pages do not count against this save
        phases.reset()
        profiler = cProfile.Profile() if profile else None
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        engine.save_checkpoint(root, tag=f"save{index}")
        if profiler:
            profiler.disable()
        seconds = time.perf_counter() - start
        start = time.perf_counter()
        os.sync()
        sync_after = time.perf_counter() - start
        listing = _files(root)
        if files is None:
            files = listing
        if profiler:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
            print(text.getvalue())
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
            print(text.getvalue())
        else:
            saves.append(dict(save_s=round(seconds, 3), sync_after_s=round(sync_after, 3), phases=phases.report()))
            print(json.dumps(saves[-1]), flush=True)
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    shutil.rmtree(root, ignore_errors=True)
    return dict(system="upstream" if UPSTREAM else "ours",
                deepspeed=f"{deepspeed.__version__} {deepspeed.__file__}",
                bf16=not args.no_bf16,
                params=params,
                files=files,
                bytes=sum(size for _, size in files),
                save_s=[s["save_s"] for s in saves],
                save_s_median=statistics.median(s["save_s"] for s in saves),
                saves=saves)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=16, help="tokens of the one training step")
    parser.add_argument("--no-bf16", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--dir", default="/var/tmp/ckpt_profile")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = run(args)
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(line + "\n")


if __name__ == "__main__":
    main()
