# SPDX-License-Identifier: Apache-2.0
"""Write the upstream-DeepSpeed pipeline checkpoint fixtures (run with an upstream install, not this package).

Command (from a directory that is not a checkout of this repository, so that upstream's ``deepspeed`` is imported)::

    cd /tmp && DS_ACCELERATOR=cpu <venv with upstream 0.19.8>/bin/python \\
        <repo>/tests/unit/checkpoint/upstream/write_pipe_fixtures.py \\
        [--out <repo>/tests/unit/checkpoint/upstream/fixtures_pipe]

Two gloo processes on the CPU run upstream's ``PipelineEngine`` over the model of :func:`layers` (an embedding
tied with the output head across the two stages) with Adam (``torch_adam``, weight decay 0.01), clipping 1.0
(none on ZeRO-0, see ``ds_config``) and 2 micro-batches per batch, for 2 batches, then
``save_checkpoint(<out>/<cell>, tag="t2")``. ``trajectory.pt`` records what upstream continues with: every
layer's parameters at the save and after one more batch, and that batch's loss. Cells: ZeRO stage 0 and 1, fp32
and bf16 (``pp2-z0-fp32``, ``pp2-z1-fp32``, ``pp2-z1-bf16``).
"""

import argparse
import os
import sys

import torch

VOCAB, DIM, SEQ, MICRO, GAS = 11, 6, 3, 2, 2
TAG = "t2"
CELLS = ("pp2-z0-fp32", "pp2-z1-fp32", "pp2-z1-bf16")


class Embedding(torch.nn.Embedding):
    """An embedding whose initial weights depend only on its seed (each stage that uses the tie builds one)."""

    def __init__(self):
        super().__init__(VOCAB, DIM)
        with torch.no_grad():
            self.weight.copy_(torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(3)) * 0.5)


def head(embedding, hidden):
    return hidden @ embedding.weight.t()


def layers():
    """The layers, as LayerSpec/TiedLayerSpec objects of whichever deepspeed is imported."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    torch.manual_seed(0)
    return [
        TiedLayerSpec("embed", Embedding),
        torch.nn.Linear(DIM, DIM),
        torch.nn.Tanh(),
        torch.nn.Linear(DIM, DIM),
        LayerSpec(torch.nn.LayerNorm, DIM),
        TiedLayerSpec("embed", Embedding, forward_fn=head),
    ]


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def batches(step, dp_rank=0):
    gen = torch.Generator().manual_seed(100 * step + dp_rank)
    return [(torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen), torch.randint(0, VOCAB, (MICRO, SEQ),
                                                                                 generator=gen)) for _ in range(GAS)]


def ds_config(cell):
    _, zero, dtype = cell.split("-")
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        # upstream's ZeRO-0 pipeline clips by the norm of stage 0's gradients only (its clip_grad_norm_ counts a
        # parameter on model-parallel rank 0, which the pipeline grid makes stage 0): no clipping there
        "gradient_clipping": 0.0 if zero == "z0" else 1.0,
        "steps_per_print": 10**6,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 0.01,
                "weight_decay": 0.01,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": int(zero[1:])
        },
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def layer_params(module):
    """``{layer index: {name: fp32 value}}`` of this stage's layers (the tie under its first layer)."""
    out = {}
    for name, p in module.named_parameters():
        if name.startswith("tied_modules."):
            index, attr = 0, name.split(".", 2)[2]
        else:
            index, attr = int(name.split(".")[0]), name.split(".", 1)[1]
        out.setdefault(index, {})[attr] = p.detach().float().clone()
    return out


def run_cell(cell, out_dir, rank, world):
    import deepspeed
    from deepspeed.pipe import PipelineModule
    model = PipelineModule(layers(), num_stages=2, loss_fn=loss_fn, partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config(cell))
    for step in range(2):
        engine.train_batch(iter(batches(step)))
    cell_dir = os.path.join(out_dir, cell)
    engine.save_checkpoint(cell_dir, tag=TAG, client_state={"epoch": 3})
    record = {"at_save": layer_params(engine.module)}
    record["next_loss"] = float(engine.train_batch(iter(batches(2))))
    record["after"] = layer_params(engine.module)
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, record)
    if rank == 0:
        merged = {
            "at_save": {},
            "after": {},
            "next_loss": gathered[0]["next_loss"],
            "ds_version": deepspeed.__version__
        }
        for rec in gathered:
            merged["at_save"].update(rec["at_save"])
            merged["after"].update(rec["after"])
        torch.save(merged, os.path.join(cell_dir, "trajectory.pt"))
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            if os.path.exists(os.path.join(cell_dir, script)):
                os.remove(os.path.join(cell_dir, script))
    torch.distributed.barrier()


def worker(rank, world, out_dir, names, port):
    os.environ.update(MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port),
                      RANK=str(rank),
                      WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    for cell in names:
        run_cell(cell, out_dir, rank, world)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(here, "fixtures_pipe"))
    parser.add_argument("--port", type=int, default=29631)
    args = parser.parse_args()
    import deepspeed
    if not os.path.realpath(deepspeed.__file__).startswith(os.path.realpath(sys.prefix)):
        sys.exit(f"this must run with upstream DeepSpeed, but deepspeed comes from {deepspeed.__file__}")
    torch.multiprocessing.spawn(worker, args=(2, args.out, list(CELLS), args.port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
