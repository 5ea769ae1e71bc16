# SPDX-License-Identifier: Apache-2.0
"""The eigenvalue monitor: on a quadratic form its eigenvalues are the known ones, and turning it on changes
nothing of training (exactly, in fp32) on ZeRO stages 0-2."""

import os

import pytest
import torch

from deepspeed.runtime.eigenvalue import Eigenvalue
from tests.unit.common import run_distributed

TIMEOUT_S = 90
BLOCKS, DIM, MICRO, GAS, STEPS = 3, 4, 16, 2, 3
EIGEN = {"enabled": True, "layer_name": "blocks", "layer_num": BLOCKS, "max_iter": 300, "tol": 1e-7}


class Quadratic(torch.nn.Module):
    """``loss = mean((sum_k w_k . x_k - y)^2)``: block k's Hessian is ``2 X_k^T X_k / n`` whatever the weights."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(DIM, 1, bias=False) for _ in range(BLOCKS)])

    def forward(self, x):
        return sum(block(x[:, k * DIM:(k + 1) * DIM]) for k, block in enumerate(self.blocks))


def batch(rank, step, micro):
    gen = torch.Generator().manual_seed(100 * rank + 10 * step + micro)
    scales = torch.arange(1, BLOCKS * DIM + 1, dtype=torch.float32) / DIM  # distinct spectra per block
    return torch.randn(MICRO, BLOCKS * DIM, generator=gen) * scales, torch.randn(MICRO, 1, generator=gen)


def known_top_eigenvalues(x):
    return [
        torch.linalg.eigvalsh(2 * x[:, k * DIM:(k + 1) * DIM].T.double() @ x[:, k * DIM:(k + 1) * DIM].double() /
                              x.shape[0]).max().item() for k in range(BLOCKS)
    ]


def test_power_iteration_finds_the_known_eigenvalues():
    model = Quadratic()
    x, y = batch(0, 0, 0)
    loss = ((model(x) - y)**2).mean()
    values = Eigenvalue(max_iter=300, tol=1e-7, layer_name="blocks").compute_block_eigenvalues(model, loss=loss)
    assert values == pytest.approx(known_top_eigenvalues(x), rel=1e-4)
    assert all(p.grad is None for p in model.parameters()), "no .grad may be written"
    loss.backward()  # the graph was retained for the training backward


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_upstream_protocol_and_normalised_form():
    model = Quadratic()
    x, y = batch(0, 0, 1)
    ((model(x) - y)**2).mean().backward(create_graph=True)
    monitor = Eigenvalue(max_iter=300, tol=1e-7, layer_name="blocks", layer_num=2)
    by_param = monitor.compute_eigenvalue(model, scale=1.0)
    known = known_top_eigenvalues(x)[:2]
    blocks = list(model.blocks)
    for index in range(2):
        value, block = by_param[id(blocks[index].weight)]
        assert block == index and value == pytest.approx(known[index] / max(known), rel=1e-4)
    assert id(blocks[2].weight) not in by_param
    for param in model.parameters():
        param.grad = None  # break the parameter <-> gradient-graph cycle


@pytest.mark.parametrize("layer_name, layer_num, words", [("encoder.layer", 0, "no submodule 'encoder'"),
                                                          ("blocks", 5, "only 3 blocks"),
                                                          ("blocks.0", 0, "not a list of blocks")])
def test_bad_block_selection(layer_name, layer_num, words):
    with pytest.raises(ValueError, match=words):
        Eigenvalue(layer_name=layer_name, layer_num=layer_num).get_blocks(Quadratic())


def train_run(stage, eigen, root):
    import deepspeed
    import deepspeed.comm as dist
    rank = dist.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.05,
                "momentum": 0.5
            }
        },
        "zero_optimization": {
            "stage": stage
        },
    }
    if eigen:
        config["eigenvalue"] = EIGEN
        config["csv_monitor"] = {"enabled": True, "output_path": root, "job_name": f"stage{stage}"}
    engine, _, _, _ = deepspeed.initialize(model=Quadratic(), config=config)
    rng_states = []
    for step in range(STEPS):
        for micro in range(GAS):
            x, y = batch(rank, step, micro)
            engine.backward(((engine(x) - y)**2).mean())
            engine.step()
        rng_states.append(torch.random.get_rng_state())
    weights = [deepspeed.utils.safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    engine.destroy()
    dist.barrier()
    events = None
    if eigen and rank == 0:
        from tests.unit.monitor.training import read_csv_dir
        events = read_csv_dir(os.path.join(root, f"stage{stage}"))
    return weights, rng_states, events


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_eigenvalue_leaves_training_unchanged(tmp_path, stage):
    on = run_distributed(train_run, 2, args=(stage, True, str(tmp_path)), timeout=TIMEOUT_S)
    off = run_distributed(train_run, 2, args=(stage, False, str(tmp_path)), timeout=TIMEOUT_S)
    for rank in range(2):
        for w_on, w_off in zip(on[rank][0], off[rank][0]):
            assert torch.equal(w_on, w_off), f"rank {rank}: weights differ with the eigenvalue monitor on"
        for s_on, s_off in zip(on[rank][1], off[rank][1]):
            assert torch.equal(s_on, s_off), "the eigenvalue monitor advanced the global RNG"
    events = on[0][2]
    batch_size = MICRO * GAS * 2
    for k in range(BLOCKS):
        header, rows = events[f"Train_Eigenvalues_ModelBlockParam_{k}.csv"]
        assert header == ["step", f"ModelBlockParam_{k}"]
        assert [s for s, _ in rows] == [(s + 1) * batch_size for s in range(STEPS)]
        # computed from rank 0's loss of the boundary micro-step
        known = [known_top_eigenvalues(batch(0, s, GAS - 1)[0])[k] for s in range(STEPS)]
        assert [v for _, v in rows] == pytest.approx(known, rel=1e-4)
    assert "Train_Samples_lr.csv" in events  # lr and eigenvalues written together at the boundary


def test_eigenvalue_gas_boundary_resolution(tmp_path):
    header, rows = run_distributed(resolution_run, 2, args=(str(tmp_path), ),
                                   timeout=TIMEOUT_S)[0]["Train_Eigenvalues_ModelBlockParam_0.csv"]
    batch_size = MICRO * GAS * 2
    assert [s for s, _ in rows] == [2 * batch_size, 4 * batch_size], "every second boundary"


def resolution_run(root):
    import deepspeed
    import deepspeed.comm as dist
    rank = dist.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.05
            }
        },
        "eigenvalue": dict(EIGEN, gas_boundary_resolution=2),
        "csv_monitor": {
            "enabled": True,
            "output_path": root,
            "job_name": "res"
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=Quadratic(), config=config)
    for step in range(4):
        for micro in range(GAS):
            x, y = batch(rank, step, micro)
            engine.backward(((engine(x) - y)**2).mean())
            engine.step()
    engine.destroy()
    dist.barrier()
    if rank == 0:
        from tests.unit.monitor.training import read_csv_dir
        return read_csv_dir(os.path.join(root, "res"))
    return None
