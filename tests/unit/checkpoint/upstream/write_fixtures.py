# SPDX-License-Identifier: Apache-2.0
"""Write the upstream-DeepSpeed checkpoint fixtures (run with an upstream install, not this package).

Command (from any directory that is not a checkout of this repository, so that the ``deepspeed``
imported is upstream's; the script checks it)::

    cd /tmp && DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=/tmp/ext-upstream \
        /work/upstream-venv/bin/python <repo>/tests/unit/checkpoint/upstream/write_fixtures.py \
        [--out <repo>/tests/unit/checkpoint/upstream/fixtures] [--cells z1-bf16,z3-fp32-offload]

Two gloo processes on the CPU (world 2) train the tiny MLP of :mod:`model` with AdamW (``torch_adam``,
weight decay 0.01), gradient clipping 1.0, 2 micro-steps of accumulation and a WarmupLR scheduler, for
3 optimizer steps, then ``save_checkpoint(<out>/<cell>, tag="t3", client_state={"epoch": 7})``. The
run then goes on for 2 more optimizer steps on the same data; ``<out>/<cell>/trajectory.pt`` records what
upstream itself continues: the full fp32 masters and Adam moments at the save and after each later step,
the later steps' losses (per rank and micro-step), and the counters.

Cells: ZeRO stage 0-3 x fp32/bf16/fp16 x CPU optimizer offload on/off (offload on stages 1-3 only: upstream
has no stage-0 offload), plus ``z1-bf16-fp32acc`` (bf16 with fp32 gradient accumulation on stage 1, which
upstream runs in its ``BF16_Optimizer`` and saves as ``bf16_zero_pp_rank_*`` files). Upstream's offload uses a
torch AdamW on the CPU masters (``zero_force_ds_cpu_optimizer: false``: no op is built). fp16 runs on the CPU
where ``torch.ops.mkldnn._is_mkldnn_fp16_supported()`` (upstream refuses fp16 otherwise); the script says which
cells it skipped and why.
"""

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import model as fixture_model  # noqa: E402  (the model and data, shared with the tests)

TAG = "t3"
SAVE_AFTER = 3
CONTINUE = 2
CLIENT_STATE = {"epoch": 7, "note": "upstream fixture"}


def cells():
    out = []
    for stage in range(4):
        for dtype in ("fp32", "bf16", "fp16"):
            for offload in ((False, ) if stage == 0 else (False, True)):
                out.append(fixture_model.cell_name(stage, dtype, offload))
    out.append("z1-bf16-fp32acc")
    return out


def full_state(engine):
    """name -> {fp32, exp_avg, exp_avg_sq} as full fp32 CPU tensors (collective on stage 3)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    result = {}
    flat_of = {}  # stage 0 with 16-bit parameters: one flat fp32 master per param group
    if hasattr(engine.optimizer, "fp32_groups_flat") and hasattr(engine.optimizer, "fp16_groups"):
        inner = engine.optimizer.optimizer
        for flat, params in zip(engine.optimizer.fp32_groups_flat, engine.optimizer.fp16_groups):
            offset = 0
            for param in params:
                n = param.numel()
                flat_of[param] = (flat, inner.state[flat], offset, n)
                offset += n
    elif hasattr(engine.optimizer, "fp32_groups") and hasattr(engine.optimizer, "fp16_groups"):
        inner = engine.optimizer.optimizer  # the unfused optimizer: one fp32 copy per parameter
        for masters, params in zip(engine.optimizer.fp32_groups, engine.optimizer.fp16_groups):
            for master, param in zip(masters, params):
                flat_of[param] = (master.view(-1), inner.state[master], 0, param.numel())
    for name, param in engine.module.named_parameters():
        if param in flat_of:
            flat, state, offset, n = flat_of[param]
            entry = {"fp32": flat.narrow(0, offset, n).view(param.shape).detach().float().clone()}
            for key in ("exp_avg", "exp_avg_sq"):
                entry[key] = state[key].reshape(-1).narrow(0, offset, n).view(param.shape).detach().float().clone()
            result[name] = entry
            continue
        fp32 = safe_get_full_fp32_param(param)
        if fp32 is None:  # stage 0 with fp32 parameters: the torch optimizer steps the parameter itself
            state = engine.optimizer.state[param]
            entry = {"fp32": param.detach().float().clone()}
            entry.update({k: state[k].detach().float().clone() for k in ("exp_avg", "exp_avg_sq")})
        else:
            entry = {"fp32": fp32.detach().float().cpu().clone()}
            for key in ("exp_avg", "exp_avg_sq"):
                entry[key] = safe_get_full_optimizer_state(param, key).detach().float().cpu().clone()
        result[name] = entry
    return result


def run_cell(cell, out_dir, rank, world):
    import deepspeed
    stage, dtype, offload, fp32acc = fixture_model.parse_cell(cell)
    config = fixture_model.ds_config(stage, dtype, offload, world, fp32acc)
    model = fixture_model.build_model(seed=0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []

    def one_step(step):
        step_losses = []
        for micro in range(fixture_model.GAS):
            x, y = fixture_model.batch(step, micro, rank)
            loss = fixture_model.loss_fn(engine(x.to(engine.device, fixture_model.torch_dtype(dtype))), y)
            engine.backward(loss)
            engine.step()
            step_losses.append(float(loss))
        return step_losses

    for step in range(SAVE_AFTER):
        one_step(step)
    cell_dir = os.path.join(out_dir, cell)
    engine.save_checkpoint(cell_dir, tag=TAG, client_state=dict(CLIENT_STATE))
    record = {"at_save": full_state(engine), "steps": []}
    record["counters"] = dict(global_steps=engine.global_steps,
                              global_samples=engine.global_samples,
                              skipped_steps=engine.skipped_steps)
    record["lr"] = engine.get_lr()
    if engine.fp16_enabled():
        record["loss_scale"] = float(
            engine.optimizer.loss_scale if hasattr(engine.optimizer, "loss_scale") else engine.optimizer.cur_scale)
    for step in range(SAVE_AFTER, SAVE_AFTER + CONTINUE):
        losses = one_step(step)
        record["steps"].append({"losses": losses, "state": full_state(engine), "lr": engine.get_lr()})
    record["optimizer_class"] = type(engine.optimizer).__name__
    record["ds_version"] = deepspeed.__version__
    record["world_size"] = world
    record["config"] = config
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, [s["losses"] for s in record["steps"]])
    record["rank_losses"] = gathered  # [rank][step][micro]
    if rank == 0:
        torch.save(record, os.path.join(cell_dir, "trajectory.pt"))
        # upstream copies its recovery scripts next to the checkpoint: they are upstream's code, not fixtures
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            if os.path.exists(os.path.join(cell_dir, script)):
                os.remove(os.path.join(cell_dir, script))
    engine.destroy()
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
        if rank == 0:
            print(f"cell {cell}", flush=True)
        run_cell(cell, out_dir, rank, world)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "fixtures"))
    parser.add_argument("--cells", default=None, help="comma-separated cell names (default: all)")
    parser.add_argument("--port", type=int, default=29611)
    args = parser.parse_args()
    import deepspeed
    if not os.path.realpath(deepspeed.__file__).startswith(os.path.realpath(sys.prefix)):
        sys.exit(f"this must run with upstream DeepSpeed, but deepspeed comes from {deepspeed.__file__}")
    names = cells() if args.cells is None else args.cells.split(",")
    from deepspeed.accelerator import get_accelerator
    if not get_accelerator().is_fp16_supported():
        skipped = [n for n in names if "fp16" in n]
        print(f"skipping {skipped}: upstream refuses fp16 on this CPU (no oneDNN fp16 support)")
        names = [n for n in names if n not in skipped]
    os.makedirs(args.out, exist_ok=True)
    world = 2
    torch.multiprocessing.spawn(worker, args=(world, args.out, names, args.port), nprocs=world, join=True)


if __name__ == "__main__":
    main()
