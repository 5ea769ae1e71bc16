# SPDX-License-Identifier: Apache-2.0
"""A small regression model, its data, an engine run and the same run in plain torch (the reference)."""

import os

import torch

SEED = 0
DIM_IN, HIDDEN, DIM_OUT = 6, 8, 3
MICRO, GAS, WORLD = 4, 2, 2
LR, GAMMA, CLIP = 0.1, 0.5, 0.5


def make_model():
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(DIM_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, DIM_OUT))


def batch(rank, step, micro):
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(MICRO, DIM_IN, generator=gen), torch.randn(MICRO, DIM_OUT, generator=gen)


def loss_fn(out, target):
    return ((out - target)**2).mean()


def base_config(**sections):
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "steps_per_print": 1 << 30,
    }
    config.update(sections)
    return config


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)


def train_engine(config, steps, rank, after_step=None):
    """Run ``steps`` optimizer steps of the native protocol; returns the engine."""
    import deepspeed
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                           lr_scheduler=step_lr,
                                           config=config)
    for step in range(steps):
        for micro in range(GAS):
            x, y = batch(rank, step, micro)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        if after_step is not None:
            after_step(engine)
    return engine


def reference_run(steps, world=WORLD):
    """The same training in plain torch: ``(rank 0's window losses, norms, lrs after each step)``."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = step_lr(optimizer)
    params = list(model.parameters())
    losses, norms, lrs = [], [], []
    for step in range(steps):
        grads = [torch.zeros_like(p) for p in params]
        window_loss = 0.0
        for rank in range(world):
            for micro in range(GAS):
                x, y = batch(rank, step, micro)
                loss = loss_fn(model(x), y)
                if rank == 0:
                    window_loss += loss.item() / GAS
                for acc, g in zip(grads, torch.autograd.grad(loss, params)):
                    acc += g / (GAS * world)
        norm = torch.sqrt(sum((g.double()**2).sum() for g in grads)).item()
        coef = min(1.0, CLIP / (norm + 1e-6))
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.grad = g * coef
        optimizer.step()
        scheduler.step()
        losses.append(window_loss)
        norms.append(norm)
        lrs.append(optimizer.param_groups[0]["lr"])
    return losses, norms, lrs


def read_csv_dir(log_dir):
    """``{header: [(step, value), ...]}`` of every CSV file of a csv_monitor directory."""
    import csv
    result = {}
    for name in sorted(os.listdir(log_dir)):
        if name.endswith(".csv"):
            with open(os.path.join(log_dir, name), newline="") as handle:
                rows = list(csv.reader(handle))
            result[name] = (rows[0], [(int(step), float(value)) for step, value in rows[1:]])
    return result


def read_tensorboard_dir(log_dir):
    """``{tag: [(step, value), ...]}`` through tensorboard's own event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def files_under(root):
    found = []
    for directory, _, names in os.walk(root):
        found += [os.path.relpath(os.path.join(directory, n), root) for n in names]
    return sorted(found)
