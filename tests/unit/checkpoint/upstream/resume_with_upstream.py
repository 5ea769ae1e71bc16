# SPDX-License-Identifier: Apache-2.0
"""Resume checkpoints written by this package with upstream DeepSpeed (run with an upstream install).

Used by ``tests/unit/checkpoint/test_upstream_roundtrip.py`` when ``DS_UPSTREAM_PYTHON`` names an interpreter
with upstream DeepSpeed; by hand (from a directory that is not a checkout of this repository)::

    DS_ACCELERATOR=cpu /work/upstream-venv/bin/python <repo>/tests/unit/checkpoint/upstream/resume_with_upstream.py \\
        --root <dir holding one folder per cell> --cells z1-fp32,z3-bf16 --out result.pt

For each cell, two gloo processes build upstream's engine from the cell's config (``model.py``, other initial
weights), ``load_checkpoint(<root>/<cell>, tag="t3")``, record the full fp32 masters and moments, the counters,
the LR and the client state, train 2 optimizer steps on the fixture data and record the state after each. Rank 0
writes ``{cell: record}`` to ``--out``.
"""

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import model as fixture_model  # noqa: E402
from write_fixtures import SAVE_AFTER, TAG, full_state  # noqa: E402


def resume_cell(root, cell, rank, world):
    import deepspeed
    stage, dtype, offload, fp32acc = fixture_model.parse_cell(cell)
    model = fixture_model.build_model(seed=1)
    config = fixture_model.ds_config(stage, dtype, offload, world, fp32acc)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    path, client = engine.load_checkpoint(os.path.join(root, cell), tag=TAG)
    record = {"path": path, "client": {k: client[k] for k in ("epoch", "note") if k in client}}
    record["counters"] = dict(global_steps=engine.global_steps,
                              global_samples=engine.global_samples,
                              skipped_steps=engine.skipped_steps)
    record["lr"] = engine.get_lr()
    # upstream's ZeRO 1/2 links its parameters to their optimizer-state fragments lazily, at the first step
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()
    record["at_load"] = full_state(engine)
    record["steps"] = []
    for step in range(SAVE_AFTER, SAVE_AFTER + 2):
        for micro in range(fixture_model.GAS):
            x, y = fixture_model.batch(step, micro, rank)
            loss = fixture_model.loss_fn(engine(x.to(engine.device, fixture_model.torch_dtype(dtype))), y)
            engine.backward(loss)
            engine.step()
        record["steps"].append({"state": full_state(engine), "lr": engine.get_lr()})
    engine.destroy()
    return record


def worker(rank, world, root, names, out, port):
    os.environ.update(MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port),
                      RANK=str(rank),
                      WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if os.environ.get("DS_TEST_TRACEBACK_AFTER_S"):  # a hang ends with every thread's traceback, not in silence
        import faulthandler
        faulthandler.dump_traceback_later(int(os.environ["DS_TEST_TRACEBACK_AFTER_S"]), exit=True)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for cell in names:
        try:
            results[cell] = resume_cell(root, cell, rank, world)
        except Exception as exc:  # reported per cell
            import traceback
            traceback.print_exc()
            sys.stderr.write(f"rank {rank}: {cell}: {type(exc).__name__}: {exc}\n")
            results[cell] = {"error": f"{type(exc).__name__}: {exc}"}
        torch.distributed.barrier()
    if rank == 0:
        torch.save(results, out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--cells", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, default=29671)
    args = parser.parse_args()
    import deepspeed
    if not os.path.realpath(deepspeed.__file__).startswith(os.path.realpath(sys.prefix)):
        sys.exit(f"this must run with upstream DeepSpeed, but deepspeed comes from {deepspeed.__file__}")
    torch.multiprocessing.spawn(worker,
                                args=(2, args.root, args.cells.split(","), args.out, args.port),
                                nprocs=2,
                                join=True)


if __name__ == "__main__":
    main()
