# SPDX-License-Identifier: Apache-2.0
"""``engine.offload_states()`` / ``reload_states()`` of the reference model's ZeRO-3 engine, one side per run.

The side is whichever ``deepspeed`` is on the path (this package, or upstream's with ``PYTHONPATH=/tmp/upstream``):
the reference GPT (benchmarks/gpt.py: d_model 2048, 24 layers) in bf16 with AdamW (upstream needs its FusedAdam
for ``offload_states``), ZeRO-3 without offload, trained ``--steps`` steps so the optimizer state exists. Then
``--cycles`` times: ``offload_states()`` (every state) and ``reload_states()``, each timed between device
synchronisations, with the device memory allocated before, after the offload and after the reload; one more
training step after the last reload shows the engine trains on. In the same process the pinned host<->device
bandwidth is measured with one copy of the same size as the state moved (the ceiling of both directions).

Prints and appends (``--out``) one JSON line:
``{side, deepspeed, gpu, params, state_bytes, pinned_h2d_gbs, pinned_d2h_gbs, cycles: [{offload_s, reload_s,
freed_bytes, left_bytes, restored_bytes}], loss_after}``. ``--tiny``: a small model on the CPU (this package
only; a logic check, no timing meaning).
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, count_params, lm_loss  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _allocated():
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def _bandwidth(numel_bytes, device):
    """Pinned host -> device and device -> host GB/s for one copy of ``numel_bytes`` (best of three)."""
    if device.type != "cuda":
        return None, None
    host = torch.empty(numel_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(numel_bytes, dtype=torch.uint8, device=device)
    h2d = d2h = float("inf")
    for _ in range(3):
        _sync()
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        _sync()
        h2d = min(h2d, time.perf_counter() - t)
        t = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        _sync()
        d2h = min(d2h, time.perf_counter() - t)
    del host, dev
    torch.cuda.empty_cache()
    return numel_bytes / h2d / 1e9, numel_bytes / d2h / 1e9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", default="ours")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29641"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    import deepspeed
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = GPTConfig(d_model=64, n_layers=2, n_heads=4, vocab=512, seq=64) if args.tiny else GPTConfig(seq=args.seq)
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = count_params(model)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 1.0,
        "bf16": {
            "enabled": True
        },
        "steps_per_print": 1 << 30,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-4,
                "weight_decay": 0.1
            }
        },
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": int(4e7)
        },
    }
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    generator = torch.Generator().manual_seed(1)

    def train_step():
        tokens = torch.randint(0, cfg.vocab, (1, cfg.seq + 1), generator=generator).to(device)
        loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        return float(loss)

    for _ in range(args.steps):
        train_step()
    _sync()
    cycles = []
    for _ in range(args.cycles):
        before = _allocated()
        t = time.perf_counter()
        engine.offload_states()
        _sync()
        offload_s = time.perf_counter() - t
        after = _allocated()
        left = after if device.type == "cuda" else engine._states.device_bytes()
        t = time.perf_counter()
        engine.reload_states()
        _sync()
        reload_s = time.perf_counter() - t
        cycles.append({
            "offload_s": offload_s,
            "reload_s": reload_s,
            "freed_bytes": before - after,
            "left_bytes": left,
            "restored_bytes": _allocated() - after
        })
    loss_after = train_step()
    moved = max(c["freed_bytes"] for c in cycles) or getattr(getattr(engine, "_states", None), "last_moved_bytes", 0)
    h2d, d2h = _bandwidth(min(int(moved), 4 << 30), device) if moved else (None, None)  # saturated long before
    result = {
        "side": args.side,
        "deepspeed": deepspeed.__file__,
        "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "params": n_params,
        "state_bytes": moved,
        "pinned_h2d_gbs": h2d,
        "pinned_d2h_gbs": d2h,
        "cycles": cycles,
        "loss_after": loss_after,
    }
    print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(json.dumps(result) + "\n")
    engine.destroy()


if __name__ == "__main__":
    main()
