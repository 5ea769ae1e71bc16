# SPDX-License-Identifier: Apache-2.0
"""Peak memory per phase (forward, backward, step) of ZeRO-3 and FSDP2 on one model (a diagnostic).

torchrun --nproc_per_node 2 benchmarks/probe_phases.py --d-model 4096 --layers 40 --heads 32 --micro-batch 2 \
    --activation-checkpointing --unit-size 2e8
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.getcwd())
from benchmarks.gpt import GPT, GPTConfig, lm_loss  # noqa: E402
from benchmarks.systems import make_system  # noqa: E402

GIB = 2**30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--unit-size", type=float, default=4e7)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--systems", default="ds_zero3,fsdp2")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # a dry run of the logic: memory reads as zero
        for fn in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
            setattr(torch.cuda, fn, lambda *a, **k: None)
        torch.cuda.memory_allocated = torch.cuda.max_memory_allocated = lambda *a, **k: 0
    cfg = GPTConfig(d_model=args.d_model,
                    n_layers=args.layers,
                    n_heads=args.heads,
                    vocab=args.vocab,
                    seq=args.seq,
                    activation_checkpointing=args.activation_checkpointing)
    hp = dict(micro_batch=args.micro_batch,
              gas=2,
              lr=1e-4,
              weight_decay=0.1,
              betas=(0.9, 0.95),
              clip=1.0,
              bucket_size=int(2.5e7),
              unit_size=int(args.unit_size))
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=gen).to(device), ) * 2
               for _ in range(2)]
    for name in args.systems.split(","):
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(cfg)
        system = make_system(name, model, hp, device)
        del model
        torch.cuda.synchronize()
        rows = [f"{name}: after setup {torch.cuda.memory_allocated(device) / GIB:.2f} GiB"]
        for step in range(2):
            for micro, (tokens, targets) in enumerate(batches):
                last = micro == len(batches) - 1
                for phase in ("forward", "backward", "step"):
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                    if phase == "forward":
                        model = system.engine if name.startswith("ds_") else system.model
                        loss = lm_loss(model(tokens), targets)
                    elif phase == "backward":
                        if name.startswith("ds_"):
                            system.engine.backward(loss)
                        else:
                            (loss / 2).backward()
                        del loss
                    elif name.startswith("ds_"):
                        system.engine.step()
                    elif last:
                        torch.nn.utils.clip_grad_norm_(system.model.parameters(), 1.0)
                        system.optimizer.step()
                        system.optimizer.zero_grad(set_to_none=True)
                    torch.cuda.synchronize()
                    rows.append(f"  step {step} micro {micro} {phase:<8} start {base / GIB:6.2f}  peak "
                                f"{torch.cuda.max_memory_allocated(device) / GIB:6.2f}  end "
                                f"{torch.cuda.memory_allocated(device) / GIB:6.2f} GiB")
        system.close()
        del system
        torch.cuda.empty_cache()
        if rank == 0:
            print("\n".join(rows), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
