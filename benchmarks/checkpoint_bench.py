# SPDX-License-Identifier: Apache-2.0
"""How long ``save_checkpoint`` blocks the training loop, per checkpoint writer, one process on one GPU.

    python3 benchmarks/checkpoint_bench.py --system ours_sync [--tiny] [--out result.jsonl]

Systems (``--system``): ``ours_sync`` (the default writer), ``ours_fast`` (``checkpoint.writer`` type fast),
``ours_decoupled`` (fast + decoupled), ``upstream_sync``, ``upstream_fast``, ``upstream_decoupled`` (the same
configs under upstream DeepSpeed 0.19.8: put it first on ``PYTHONPATH`` and set ``DS_BENCH_UPSTREAM=1``; its fast
writer JIT-builds the ``async_io`` op, which needs libaio: ``upstream_python`` and ``upstream_decoupledpython`` use
its ``python`` writer type instead), and ``torch_dcp_async`` (plain torch: the model and a torch AdamW,
``torch.distributed.checkpoint.async_save``).

Each system trains the reference GPT (``benchmarks/gpt.py``; smaller by default so that every system fits in the
run: ``--d-model``/``--layers``), bf16, AdamW, ZeRO stage 1 on one rank; ``--warmup`` steps give the median step
time, then ``--saves`` times: a save, then ``--after`` steps. Per save it records:

* ``call_s``: the wall time of the save call (between device synchronisations);
* ``excess_s``: what the ``--after`` following steps took beyond the median step (upstream's decoupled writer
  commits, waiting for the files, at the next ``engine.step()``; a background writer may also slow steps down);
* ``blocked_s = call_s + excess_s``: the time the training loop lost to the save;
* ``durable_s``: from the call until the files are on disk and committed (``latest`` written), the ``--after``
  steps included (a background write overlaps them);
* ``on_disk_s``: ``durable_s`` plus an ``os.sync()`` after it: a writer that does not ``fsync`` its files (upstream's
  ``torch.save``, its ``python`` writer) has them on the device only then; one that does pays next to nothing here.

Prints and appends one JSON line per system to ``--out``. ``--tiny`` runs a small model on the CPU (a check of the
script). ``benchmarks/checkpoint_bench.sh`` runs every system in one command.
"""

import argparse
import json
import os
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

from benchmarks.gpt import GPT, GPTConfig, lm_loss  # noqa: E402

# ``data_parallel: replica`` because upstream 0.19.8's writer fails without it when there is no mpu
# (``AttributeError: 'UniversalParallelInfo' object has no attribute 'dp_rank'``); it has no effect here.
WRITERS = {
    "sync": None,
    "fast": {
        "type": "fast",
        "data_parallel": "replica"
    },
    "decoupled": {
        "type": "fast",
        "decoupled": True,
        "data_parallel": "replica"
    },
    "python": {
        "type": "python",
        "data_parallel": "replica"
    },
    "decoupledpython": {
        "type": "python",
        "decoupled": True,
        "data_parallel": "replica"
    },
}


def _env():
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    # upstream's data-parallel writer config reads these
    os.environ.setdefault("CROSS_RANK", "0")
    os.environ.setdefault("CROSS_SIZE", "1")
    os.environ.setdefault("LOCAL_SIZE", "1")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def ds_config(micro_batch, bf16):
    """The DeepSpeed config of every system of this benchmark (and of checkpoint_profile.py): ZeRO-1, torch's AdamW."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-4,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": 1
        },
        "bf16": {
            "enabled": bf16
        },
        "steps_per_print": 10**9,
    }


class DeepSpeedRun:
    """Ours or upstream's engine (whichever ``import deepspeed`` finds)."""

    def __init__(self, model, writer, args, device):
        import deepspeed
        print(f"deepspeed {deepspeed.__version__} from {deepspeed.__file__}", flush=True)
        cfg = ds_config(args.micro, bf16=device.type == "cuda")
        if writer is not None:
            cfg["checkpoint"] = {"writer": dict(writer)}
        self.engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
        self.decoupled = bool(writer and writer.get("decoupled"))

    def step(self, tokens, targets):
        loss = lm_loss(self.engine(tokens), targets)
        self.engine.backward(loss)
        self.engine.step()
        return loss

    def save(self, directory, tag):
        self.engine.save_checkpoint(directory, tag=tag)

    def durable(self, directory, tag):
        """Block until the save of ``tag`` is committed."""
        ckpt = self.engine.checkpoint_engine
        if not self.decoupled:
            return
        if hasattr(ckpt, "wait") and not UPSTREAM:
            ckpt.wait()
        elif hasattr(self.engine, "_commit_decoupled_checkpoint"):  # upstream: the commit of its next step
            self.engine._commit_decoupled_checkpoint()

    def close(self):
        if hasattr(self.engine, "destroy"):
            self.engine.destroy()


class TorchDCPRun:
    """Plain torch: fp32 parameters, bf16 autocast, torch AdamW; ``torch.distributed.checkpoint.async_save``."""

    def __init__(self, model, args, device):
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
        self.model = model
        self.device = device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.future = None

    def step(self, tokens, targets):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = lm_loss(self.model(tokens), targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def save(self, directory, tag):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        if self.future is not None:
            self.future.result()
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        self.future = dcp.async_save({
            "model": model_state,
            "optim": optim_state
        },
                                     checkpoint_id=os.path.join(directory, tag))

    def durable(self, directory, tag):
        if self.future is not None:
            self.future.result()
            self.future = None

    def close(self):
        self.durable(None, None)


def _dir_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def run(args):
    _env()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    if args.tiny:
        cfg = GPTConfig(d_model=64, n_layers=2, n_heads=4, vocab=512, seq=32)
    else:
        cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.d_model // 64, seq=args.seq)
    torch.manual_seed(1234)
    model = GPT(cfg).to(device)
    params = sum(p.numel() for p in model.parameters())
    family, _, writer_name = args.system.partition("_")
    if family == "torch":
        runner = TorchDCPRun(model, args, device)
    else:
        runner = DeepSpeedRun(model, WRITERS[writer_name], args, device)
    gen = torch.Generator().manual_seed(0)

    def batch():
        tokens = torch.randint(0, cfg.vocab, (args.micro, cfg.seq + 1), generator=gen).to(device)
        return tokens[:, :-1], tokens[:, 1:]

    def timed_step():
        tokens, targets = batch()
        _sync(device)
        start = time.perf_counter()
        runner.step(tokens, targets)
        _sync(device)
        return time.perf_counter() - start

    directory = os.path.join(args.dir, args.system)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)
    warm = [timed_step() for _ in range(args.warmup)]
    median = statistics.median(warm[1:] if len(warm) > 1 else warm)
    saves = []
    for index in range(args.saves):
        tag = f"save{index}"
        _sync(device)
        start = time.perf_counter()
        runner.save(directory, tag)
        _sync(device)
        call = time.perf_counter() - start
        after = [timed_step() for _ in range(args.after)]
        runner.durable(directory, tag)
        durable = time.perf_counter() - start  # the following steps included: a background write overlaps them
        os.sync()  # what a writer that does not fsync leaves in the page cache reaches the device
        on_disk = time.perf_counter() - start
        excess = sum(max(0.0, t - median) for t in after)
        saves.append(
            dict(call_s=round(call, 4),
                 excess_s=round(excess, 4),
                 blocked_s=round(call + excess, 4),
                 durable_s=round(durable, 4),
                 on_disk_s=round(on_disk, 4),
                 after_steps_s=[round(t, 4) for t in after]))
    runner.close()
    size = _dir_bytes(directory)
    shutil.rmtree(directory, ignore_errors=True)
    deepspeed = sys.modules.get("deepspeed")
    result = dict(system=args.system,
                  device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                  deepspeed=None if deepspeed is None else f"{deepspeed.__version__} {deepspeed.__file__}",
                  params=params,
                  checkpoint_bytes_per_save=size // max(1, args.saves),
                  median_step_s=round(median, 4),
                  saves=saves,
                  blocked_s_mean=round(statistics.mean(s["blocked_s"] for s in saves), 4),
                  call_s_mean=round(statistics.mean(s["call_s"] for s in saves), 4))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", required=True)
    parser.add_argument("--tiny", action="store_true", help="a small model on the CPU")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--saves", type=int, default=2)
    parser.add_argument("--after", type=int, default=4)
    parser.add_argument("--dir", default=os.environ.get("CKPT_BENCH_DIR", "/tmp/ckpt_bench"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    try:
        result = run(args)
    except Exception as exc:  # the row says what failed; the other systems still run
        import traceback
        traceback.print_exc()
        result = dict(system=args.system, error=f"{type(exc).__name__}: {exc}"[:500])
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(line + "\n")
    os._exit(0)  # a writer process or thread of a failed system must not hold the run


if __name__ == "__main__":
    main()
