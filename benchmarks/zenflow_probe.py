# SPDX-License-Identifier: Apache-2.0
"""ZenFlow's CPU probe: a small MLP regression trained by ZenFlow, by plain AdamW and by plain-torch models.

The model is an MLP (default widths 32-64-64-8, tanh) fitting a fixed random teacher; every rank gets its own
micro-batch each step (``--world`` ranks' worth of data). Systems (``--system``):

* ``engine``: ``deepspeed.initialize`` with ZeRO-2, CPU optimizer offload and the ``--zenflow`` section (fp32,
  AdamW), one ``engine.step()`` per micro-batch; run it under ``torchrun --nproc_per_node W``. Whichever
  ``deepspeed`` imports: this package, or upstream's with ``DS_BENCH_UPSTREAM=1`` and its site on the path;
* ``adamw``: plain torch AdamW on the mean gradient over the ranks' micro-batches;
* ``reference``: ``tests/unit/zenflow/reference.py``, the plain-torch ZenFlow this package implements;
* ``upstream-model``: ``benchmarks/zenflow_upstream_model.py``, what upstream 0.19.8's ZenFlow computes, with its
  errors (``--fixed`` turns them off); one rank's selection rule.

Prints one JSON line (system, losses per step, the mean of the last 10) and, with ``--dump FILE``, saves the
parameters after every step; ``--compare FILE`` prints the largest difference from another run's dump per step.

    torchrun --nproc_per_node 2 benchmarks/zenflow_probe.py --system engine --zenflow '{"update_interval": 2, ...}'
    python benchmarks/zenflow_probe.py --system reference --world 2 --zenflow '{...}'
"""

import argparse
import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.environ.get("DS_BENCH_UPSTREAM", "") == "1":  # the other deepspeed first, this repository's files after it
    sys.path.append(_ROOT)
else:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

MICRO = 16


def build(widths):
    torch.manual_seed(0)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    model = nn.Sequential(*layers[:-1])
    teacher = nn.Sequential(nn.Linear(widths[0], 16), nn.Tanh(), nn.Linear(16, widths[-1]))
    return model, teacher


def batch(teacher, widths, step, rank):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(MICRO, widths[0], generator=gen)
    with torch.no_grad():
        return x, teacher(x)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", choices=["engine", "adamw", "reference", "upstream-model"], required=True)
    p.add_argument("--zenflow", type=json.loads, default={}, help="the zenflow section (JSON)")
    p.add_argument("--widths", default="32,64,64,8")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--world", type=int, default=None, help="ranks of data (plain-torch systems; engine: the world)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--fixed", action="store_true", help="upstream-model: with its errors turned off")
    p.add_argument("--dump", default=None)
    p.add_argument("--compare", default=None)
    p.add_argument("--label", default=None)
    return p.parse_args(argv)


def run_engine(args, widths, model, teacher):
    import deepspeed
    import deepspeed.comm as dist
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1 << 30,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": args.lr,
                "weight_decay": 0.0
            }
        },
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {
                "device": "cpu"
            },
            "overlap_comm": True,
            "zenflow": args.zenflow
        },
    }
    if args.clip:
        config["gradient_clipping"] = args.clip
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    losses, dump = [], []
    for step in range(args.steps):
        x, y = batch(teacher, widths, step, rank)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        total = torch.tensor([float(loss)])
        dist.all_reduce(total)
        losses.append(float(total) / world)
        if args.dump or args.compare:
            dump.append({k: v.detach().float().clone() for k, v in engine.module.state_dict().items()})
    engine.destroy()
    label = f"engine deepspeed {deepspeed.__version__} world {world}"
    return (losses, dump, label) if rank == 0 else (None, None, None)


def run_plain(args, widths, model, teacher):
    from torch.func import functional_call
    world = args.world or 1
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    zf = args.zenflow
    interval = zf.get("select_interval", "auto")
    interval = None if interval == "auto" else int(interval)
    update = zf.get("update_interval", "auto")
    if args.system == "adamw":
        weights = {k: torch.nn.Parameter(v) for k, v in params.items()}
        opt = torch.optim.AdamW(list(weights.values()), lr=args.lr, weight_decay=0.0, foreach=False)
        current = lambda: weights  # noqa: E731
        step_fn = None
    elif args.system == "reference":
        from tests.unit.zenflow.reference import ZenFlowReference
        ref = ZenFlowReference(params,
                               lr=args.lr,
                               clip=args.clip,
                               topk=zf.get("topk_ratio", 0.1),
                               update_every=None if update == "auto" else int(update),
                               select_every=interval,
                               warm_up=zf.get("full_warm_up_rounds", 0),
                               overlap=zf.get("overlap_step", False),
                               auto_ratio=zf.get("auto_ratio", 0.99),
                               window_update=zf.get("window_update", "once"),
                               apply_after=zf.get("overlap_apply_after", "window"))
        current, step_fn = (lambda: ref.Q), ref.step
    else:
        from benchmarks.zenflow_upstream_model import UpstreamZenFlowModel
        flags = dict(layout_bug=False, bucket_offset_bug=False, host_step_count_bug=False,
                     moment_sets_bug=False) if args.fixed else {}
        up = UpstreamZenFlowModel(params,
                                  lr=args.lr,
                                  clip=args.clip,
                                  topk=zf.get("topk_ratio", 0.1),
                                  update_interval=int(update),
                                  select_interval=interval or 0,
                                  warm_up=zf.get("full_warm_up_rounds", 0),
                                  overlap=zf.get("overlap_step", False),
                                  **flags)
        current, step_fn = (lambda: up.P), up.step
    losses, dump = [], []
    for step in range(args.steps):
        at = {k: v.detach().clone().requires_grad_(True) for k, v in current().items()}
        grads, total = None, 0.0
        for r in range(world):
            x, y = batch(teacher, widths, step, r)
            loss = F.mse_loss(functional_call(model, at, (x, )), y)
            g = torch.autograd.grad(loss, list(at.values()))
            grads = list(g) if grads is None else [a + b for a, b in zip(grads, g)]
            total += float(loss.detach())
        losses.append(total / world)
        grads = {k: g / world for k, g in zip(at, grads)}
        if step_fn is None:
            for k, p in current().items():
                p.grad = grads[k]
            opt.step()
        else:
            step_fn(grads)
        if args.dump or args.compare:
            dump.append({k: v.detach().clone() for k, v in current().items()})
    return losses, dump, f"{args.system}{' fixed' if args.fixed else ''} world {world}"


def main(argv=None):
    args = parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    model, teacher = build(widths)
    run = run_engine if args.system == "engine" else run_plain
    losses, dump, label = run(args, widths, model, teacher)
    if losses is None:
        return 0
    row = dict(system=args.label or label,
               zenflow=args.zenflow,
               losses=losses,
               final_loss=losses[-1],
               mean_last10=sum(losses[-10:]) / len(losses[-10:]))
    print(json.dumps(row), flush=True)
    if args.dump:
        torch.save(dump, args.dump)
    if args.compare:
        other = torch.load(args.compare)
        for step, (mine, theirs) in enumerate(zip(dump, other)):
            diff = max(float((mine[k] - theirs[k]).abs().max()) for k in mine)
            print(f"step {step}: largest difference {diff:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
