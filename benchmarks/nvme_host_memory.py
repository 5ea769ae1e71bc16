# SPDX-License-Identifier: Apache-2.0
"""What host memory holds under NVMe offload: a ledger of the engine's host tensors, and the process's resident size.

Trains the benchmark GPT (``gpt.py``) with ZeRO-3, parameters and optimizer on NVMe and ``benchmarks/systems.py``'s
``+nvme`` keys (page sizes scaled by ``--scale`` so a small model on the CPU has as many pages as the 0.5e9 one on
the GPU), world 1, and prints one JSON object: the resident size (``VmRSS``) after import, after the model, after
``initialize`` and its peak over the steps, and the ledger: every host buffer the engine holds during the steps, by
what it is for, in bytes and bytes per element of the rank's partition (so the table scales to the benchmark's
0.5e9 elements), page-locked or not. docs/offload.md ("What stays in host memory") has the table of the 0.5e9 run.

    python benchmarks/nvme_host_memory.py --nvme-path /var/tmp/nvme_host --device cpu --out OUT.json  # CPU, small
"""

import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import host_rss  # noqa: E402
from benchmarks.gpt import GPT, GPTConfig, lm_loss  # noqa: E402
from benchmarks.systems import NVME_SECTIONS  # noqa: E402


def _nbytes(t):
    return 0 if t is None else t.numel() * t.element_size()


def _pinned(t):
    return bool(t is not None and t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned())


def ledger(engine):
    """``[(what, bytes, pinned)]``: the host buffers of ``engine``'s stage (ZeRO-3 with offload)."""
    stage = engine._stage
    rows = []

    def add(what, tensors):
        tensors = [t for t in tensors if t is not None and t.device.type == "cpu"]
        if tensors:
            rows.append((what, sum(_nbytes(t) for t in tensors), any(_pinned(t) for t in tensors)))

    add("fp32 gradient partitions (the window's sum, folded on the host)", list(stage.grad_parts))
    add("fp32 masters held in host memory (empty while the optimizer tier is swapped out)",
        [m.data for m in stage.masters])
    state = [v for m in stage.masters for v in stage.optimizer.state.get(m, {}).values() if torch.is_tensor(v)]
    add("optimizer state held in host memory (the step count only, while swapped out)", state)
    add("16-bit shards held in host memory (none while the parameter tier is swapped out)",
        [s for s in stage.shards if s is not None])
    host_step = stage.host_step
    if host_step is not None and not stage._host_shards:
        add("16-bit upload buffers of the host step", [t for t in host_step.targets if t is not None])
    for name, tier in (("optimizer tier cache (pages of masters and state)", host_step.swap if host_step else None),
                       ("parameter tier cache (pages of 16-bit shards)", getattr(stage, "param_tier", None))):
        if tier is not None:
            buffers = [b for slot in tier.store._buffers for b in slot.values()]
            add(f"{name}: {tier.store.slots} slots", buffers)
    folder = stage.geometry.folder
    rings = getattr(folder, "_rings", {}) or {}
    add("host folder rings (device chunks waiting for their host add, GAS > 1)",
        [b for ring in rings.values() for b in ring.buffers])
    fetch = stage.fetch
    if fetch is not None and fetch._ring is not None:
        add("shard fetch staging ring (pageable shards only)", fetch._ring.buffers)
    return rows


def full_scale_caches():
    """The two tiers' caches for the benchmark's keys (``NVME_SECTIONS``) at 0.5e9 elements, world 1, in GiB: pages
    of ``min(sub_group_size, 2**24)`` elements (ZeRO-3 shares one page table between the tiers, so the parameter
    tier's pages are that size too); the optimizer tier caches ``buffer_count`` pages of 12 bytes an element, the
    parameter tier ``max(buffer_count pages, max_in_cpu elements)`` of 2 bytes, at most the whole partition."""
    from deepspeed.runtime.swap_tensor.swap_config import OPTIMIZER_PAGE_CAP
    partition = 5e8
    page = min(NVME_SECTIONS["sub_group_size"], OPTIMIZER_PAGE_CAP, NVME_SECTIONS["offload_param"]["buffer_size"])
    opt = NVME_SECTIONS["offload_optimizer"]["buffer_count"] * page * 12
    param_elements = max(NVME_SECTIONS["offload_param"]["buffer_count"] * page,
                         NVME_SECTIONS["offload_param"]["max_in_cpu"])
    param = min(param_elements, partition) * 2
    return {"optimizer_tier": round(opt / 2**30, 2), "parameter_tier": round(param / 2**30, 2)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the JSON object to this file")
    parser.add_argument("--scale",
                        type=float,
                        default=None,
                        help="page and cache sizes times this (default: the model's size over 0.5e9)")
    args = parser.parse_args()

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    report = {"rss_import_gib": host_rss.current()}
    import deepspeed
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, vocab=args.vocab, seq=args.seq)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = GPT(cfg)
    numel = sum(p.numel() for p in model.parameters())
    scale = args.scale or numel / 5e8
    report.update(parameters=numel, scale=scale, rss_model_gib=host_rss.current())
    sections = json.loads(json.dumps(NVME_SECTIONS))
    sections["sub_group_size"] = max(64, int(NVME_SECTIONS["sub_group_size"] * scale))
    sections["offload_param"]["buffer_size"] = max(64, int(NVME_SECTIONS["offload_param"]["buffer_size"] * scale))
    sections["offload_param"]["max_in_cpu"] = max(64, int(NVME_SECTIONS["offload_param"]["max_in_cpu"] * scale))
    zero = {"stage": 3, "sub_group_size": sections["sub_group_size"]}
    zero["offload_optimizer"] = dict(sections["offload_optimizer"],
                                     device="nvme",
                                     nvme_path=args.nvme_path,
                                     pin_memory=True)
    zero["offload_param"] = dict(sections["offload_param"], device="nvme", nvme_path=args.nvme_path, pin_memory=True)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.gas,
        "gradient_clipping": 1.0,
        "bf16": {
            "enabled": True
        },
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-4,
                "weight_decay": 0.1,
                "betas": [0.9, 0.95]
            }
        },
        "zero_optimization": zero,
        "aio": sections["aio"],
        "steps_per_print": 10**9,
    }
    os.makedirs(args.nvme_path, exist_ok=True)
    engine = deepspeed.initialize(model=model, config=config)[0]
    del model
    gc.collect()
    report["rss_initialized_gib"] = host_rss.current()
    gen = torch.Generator().manual_seed(1)
    sampler = host_rss.Sampler()
    for _ in range(args.steps):
        for _ in range(args.gas):
            tokens = torch.randint(0, cfg.vocab, (args.micro_batch, cfg.seq + 1), generator=gen).to(args.device)
            loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
            engine.backward(loss)
            engine.step()
    report["rss_steps_peak_gib"] = sampler.stop()
    partition = sum(engine._stage.host_step.group_numel)
    rows = ledger(engine)
    report["partition_elements"] = partition
    report["ledger"] = [{
        "what": what,
        "bytes": nbytes,
        "bytes_per_element": round(nbytes / max(1, partition), 3),
        "pinned": pinned
    } for what, nbytes, pinned in rows]
    report["caches_at_5e8_gib"] = full_scale_caches()
    report["ledger_gib"] = round(sum(n for _, n, _ in rows) / 2**30, 4)
    engine.destroy()
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
