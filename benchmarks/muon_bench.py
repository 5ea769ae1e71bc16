# SPDX-License-Identifier: Apache-2.0
"""Muon on one GPU: step time, peak memory and the optimizer step's share, this package against upstream 0.19.8.

One system per process (``--system``); ``benchmarks/muon_bench.sh`` runs them all. Systems: ``ours_muon_z2``,
``ours_muon_z3``, ``ours_adamw_z2``, ``ours_adamw_z3`` (this package) and ``upstream_muon_z2``,
``upstream_muon_z3`` (run with ``PYTHONPATH=/tmp/upstream``; upstream refuses Muon at ZeRO-3 with its default
``reduce_scatter: true``, which is recorded as the result). The model is ``benchmarks/gpt.py``'s GPT with its
embeddings renamed ``embed_*`` so that upstream's name rule puts them on AdamW on both sides (its rule looks for
``embed``; the tied head is the token embedding). bf16, ``torch_adam: true`` for the Adam half on both sides (no
JIT build). Prints one JSON line per system and appends it to ``$OUT/muon_bench.jsonl`` when ``OUT`` is set.
"""

import argparse
import json
import os
import sys
import time

import torch

# benchmarks/ only (not the repository root): PYTHONPATH decides which deepspeed is measured
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, lm_loss  # noqa: E402


class MuonGPT(GPT):
    """GPT with its embeddings registered as ``embed_tok`` / ``embed_pos`` (AdamW under upstream's rule)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.embed_tok = self._modules.pop("tok_emb")
        self.embed_pos = self._modules.pop("pos_emb")

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed_tok(tokens) + self.embed_pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


SIZES = {
    "gpu": dict(cfg=GPTConfig(d_model=1024, n_layers=12, n_heads=16, vocab=50304, seq=1024), micro=8),
    "tiny": dict(cfg=GPTConfig(d_model=64, n_layers=2, n_heads=4, vocab=128, seq=32), micro=2),
}


def config(system, micro, clip=1.0):
    stage = 3 if system.endswith("z3") else 2
    if "muon" in system:
        optimizer = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-4, "weight_decay": 0.01, "torch_adam": True}}
    else:
        optimizer = {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "bf16": {
            "enabled": torch.cuda.is_available()
        },
        "optimizer": optimizer,
        "zero_optimization": {
            "stage": stage
        },
        "steps_per_print": 10**9,
    }


def run(system, size, steps, warmup, clip=1.0):
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    import deepspeed
    deepspeed.init_distributed()
    spec = SIZES[size]
    cfg, micro = spec["cfg"], spec["micro"]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = MuonGPT(cfg)
    upstream_side = system.startswith("upstream")
    if upstream_side != (deepspeed.__version__ == "0.19.8"):  # PYTHONPATH picked the wrong package
        return dict(system=system,
                    status="wrong deepspeed",
                    deepspeed=deepspeed.__file__,
                    version=deepspeed.__version__)
    result = dict(system=system,
                  deepspeed=deepspeed.__file__,
                  version=deepspeed.__version__,
                  size=size,
                  device=torch.cuda.get_device_name(0) if cuda else "cpu",
                  d_model=cfg.d_model,
                  n_layers=cfg.n_layers,
                  seq=cfg.seq,
                  micro=micro)
    try:
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               model_parameters=model.parameters(),
                                               config=config(system, micro, clip))
    except Exception as error:  # upstream's ZeRO-3 refusal is a result
        result.update(status="refused", error=f"{type(error).__name__}: {error}"[:300])
        return result
    if "muon" in system:
        result["muon_params"] = sum(p.numel() for p in model.parameters() if getattr(p, "use_muon", False))
    gen = torch.Generator().manual_seed(1)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    step_times, opt_times, losses = [], [], []
    for i in range(warmup + steps):
        tokens = torch.randint(0, cfg.vocab, (micro, cfg.seq + 1), generator=gen).to(device)
        sync()
        t0 = time.perf_counter()
        loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
        engine.backward(loss)
        sync()
        t1 = time.perf_counter()
        engine.step()
        sync()
        t2 = time.perf_counter()
        losses.append(float(loss.detach()))
        if i == warmup - 1 and cuda:
            torch.cuda.reset_peak_memory_stats()
        if i >= warmup:
            step_times.append(t2 - t0)
            opt_times.append(t2 - t1)
    step_times.sort()
    opt_times.sort()
    median = step_times[len(step_times) // 2]
    opt = opt_times[len(opt_times) // 2]
    result.update(status="ok",
                  step_s=round(median, 4),
                  optimizer_step_s=round(opt, 4),
                  optimizer_share=round(opt / median, 3),
                  peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                  losses=[round(x, 4) for x in losses])
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", required=True)
    parser.add_argument("--size", default="gpu", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--clip", type=float, default=1.0)
    args = parser.parse_args()
    result = run(args.system, args.size, args.steps, args.warmup, args.clip)
    line = json.dumps(result)
    print(line, flush=True)
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "muon_bench.jsonl"), "a") as handle:
            handle.write(line + "\n")


if __name__ == "__main__":
    main()
