# SPDX-License-Identifier: Apache-2.0
"""Write the upstream-DeepSpeed AutoEP checkpoint fixture (run with an upstream install, not this package).

Command (from a directory that is not a checkout of this repository, so that upstream's ``deepspeed`` is imported)::

    cd /tmp && DS_ACCELERATOR=cpu <venv with upstream 0.19.8>/bin/torchrun --nproc_per_node 2 \\
        <repo>/tests/unit/checkpoint/upstream/write_autoep_fixtures.py \\
        [--stage 1] [--out <repo>/tests/unit/checkpoint/upstream/fixtures_autoep]

Two gloo processes on the CPU run upstream's AutoEP (``expert_parallel {enabled, autoep_size: 2}``) over the tiny
Mixtral of ``tests/unit/moe/autoep_models.py`` (fp32, ZeRO stage 1, Adam with ``torch_adam``, weight decay 0),
for 2 steps, then ``save_checkpoint(<out>/ep2-z1, tag="t2")``; ``trajectory.pt`` records the losses of the next 2
steps upstream takes (rank ``r``, step ``s``: the tokens of :func:`tokens`). Upstream 0.19.8's AutoEP runs on
CPU and gloo. With ``--nproc_per_node 4 ... --stage 2`` the cell is ``ep2-z2-w4``: each expert-data-parallel
group holds two ranks, which split the experts' optimizer partitions between them; the model has three layers
there, so that the split falls inside a parameter (layer 1's ``w2``), not between two.
"""

import argparse
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
TAG = "t2"
CELL = "ep2-z1"


def cell(stage, world):
    """The fixture directory's name for ZeRO ``stage`` over ``world`` ranks (ep 2)."""
    return f"ep2-z{stage}" + (f"-w{world}" if world != 2 else "")


def tokens(step, rank):
    return (torch.arange(6) * (step + 1) + rank).remainder(32).unsqueeze(0)


def model_overrides(world):
    """The tiny Mixtral's config overrides for a fixture written over ``world`` ranks."""
    return {"num_hidden_layers": 3} if world != 2 else {}


def ds_config(torch_adam, stage=1):
    params = {"lr": 0.01, "weight_decay": 0.0}
    if torch_adam:
        params["torch_adam"] = True
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": stage
        },
        "optimizer": {
            "type": "Adam",
            "params": params
        },
        "expert_parallel": {
            "enabled": True,
            "autoep_size": 2
        }
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(REPO, "tests/unit/checkpoint/upstream/fixtures_autoep"))
    args = parser.parse_args()
    import deepspeed
    sys.path.insert(0, REPO)
    from tests.unit.moe.autoep_models import mixtral
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    print("deepspeed", deepspeed.__version__, deepspeed.__file__)
    model = mixtral(**model_overrides(torch.distributed.get_world_size()))
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config(True, args.stage))
    for step in range(2):
        ids = tokens(step, rank)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    out = os.path.join(args.out, cell(args.stage, torch.distributed.get_world_size()))
    engine.save_checkpoint(out, tag=TAG)
    losses = []
    for step in range(2, 4):
        ids = tokens(step, rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, losses)
    if rank == 0:
        torch.save({"losses": everyone, "deepspeed": deepspeed.__version__}, os.path.join(out, "trajectory.pt"))
        for name in ("zero_to_fp32.py", "zero_to_torch.py"):
            path = os.path.join(out, name)
            if os.path.exists(path):
                os.remove(path)


if __name__ == "__main__":
    main()
