# SPDX-License-Identifier: Apache-2.0
"""The universal format: ``ds_to_universal`` on checkpoints of either implementation, ``load_universal`` anywhere.

Each cell takes a checkpoint (saved here on 2 ranks after 3 steps of the fixture MLP, or one of upstream's
fixtures), converts it with ``python -m deepspeed.checkpoint.ds_to_universal`` (a subprocess, as a user runs
it), checks upstream's folder layout (``zero/<name>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt``, ``step.pt``,
``zero/optimizer_state.pt``, the model-states files), and loads it with ``"checkpoint": {"load_universal":
true}`` on another world size and stage: right after the load every fp32 master, ``exp_avg`` and
``exp_avg_sq`` equals the saved one bitwise, and so do the counters and the client state. An upstream
checkpoint without ``universal_checkpoint_info`` converts only with ``--inject_missing_state``.
"""

import os
import subprocess
import sys

import pytest
import torch

from tests.unit.checkpoint import test_checkpoint_resume as common
from tests.unit.checkpoint import test_upstream_fixtures as fixtures
from tests.unit.checkpoint.upstream import model as fixture_model
from tests.unit.common import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def save_worker(root, cell):
    import deepspeed
    import deepspeed.comm as dist
    common.attach_checkpointing()
    rank = dist.get_rank()
    stage, dtype, offload, fp32acc = fixture_model.parse_cell(cell)
    model = fixture_model.build_model(seed=0)
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model.parameters(),
                                           config=fixtures.our_config(stage, dtype, offload, 2, fp32acc))
    for step in range(fixtures.SAVE_AFTER):
        for x, y in fixtures.batches(step, rank, 2):
            engine.backward(fixture_model.loss_fn(engine(x.to(fixture_model.torch_dtype(dtype))), y))
            engine.step()
    engine.save_checkpoint(root, tag=fixtures.TAG, client_state={"epoch": 7, "note": "ours"})
    record = {"at_save": fixtures.state_of(engine), "global_steps": engine.global_steps}
    engine.destroy()
    return record


def load_worker(root, tag, cell, stage, world, record, client):
    import deepspeed
    import deepspeed.comm as dist
    common.attach_checkpointing()
    rank = dist.get_rank()
    _, dtype, _, _ = fixture_model.parse_cell(cell)
    config = fixtures.our_config(stage, dtype, False, world)
    config["checkpoint"] = {"load_universal": True}
    model = fixture_model.build_model(seed=1)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    path, returned = engine.load_checkpoint(root, tag=tag)
    assert path is not None
    for key, value in client.items():
        assert returned[key] == value, (key, returned.get(key))
    assert engine.global_steps == record["global_steps"]
    fixtures.compare(fixtures.state_of(engine), record["at_save"], 0.0,
                     f"rank {rank}: after loading the universal checkpoint of {cell} on {world} ranks, stage {stage}")
    # the engine trains on: one more step
    for x, y in fixtures.batches(fixtures.SAVE_AFTER, rank, world):
        engine.backward(fixture_model.loss_fn(engine(x.to(fixture_model.torch_dtype(dtype))), y))
        engine.step()
    engine.destroy()
    return True


def convert(source, output, inject=False):
    command = [
        sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", source, "--output_folder",
        output
    ] + (["--inject_missing_state"] if inject else [])
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def check_layout(folder, names, stage):
    zero = os.path.join(folder, "zero")
    assert os.path.isfile(os.path.join(zero, "optimizer_state.pt"))
    for name in names:
        files = set(os.listdir(os.path.join(zero, name)))
        assert {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt"} <= files, (name, files)
        fp32 = torch.load(os.path.join(zero, name, "fp32.pt"), weights_only=False)
        assert set(fp32) >= {"param", "cat_dim"}
    models = [f for f in os.listdir(folder) if f.endswith("_model_states.pt")]
    assert models == ["mp_rank_00_model_states.pt"] if stage < 3 else len(models) == 2, models


OURS = [("z1-fp32", 3, 1), ("z3-bf16", 0, 3), ("z0-fp16", 2, 1), ("z2-fp32", 1, 3)]


@pytest.mark.parametrize("cell,stage,world", OURS, ids=[f"ours-{c}-to-z{s}w{w}" for c, s, w in OURS])
def test_universal_round_trip(tmp_path, cell, stage, world):
    root = str(tmp_path / "ckpt")
    record = run_distributed(save_worker, 2, args=(root, cell), timeout=120)[0]
    done = convert(os.path.join(root, fixtures.TAG), os.path.join(root, "t3_universal"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    check_layout(os.path.join(root, "t3_universal"), list(record["at_save"]), fixture_model.parse_cell(cell)[0])
    with open(os.path.join(root, "latest_universal"), "w") as handle:
        handle.write("t3_universal")
    client = {"epoch": 7, "note": "ours"}
    assert run_distributed(load_worker, world, args=(root, None, cell, stage, world, record, client),
                           timeout=120) == [True] * world


UPSTREAM = [("z2-bf16", 1, 1), ("z3-fp16", 2, 3), ("z0-fp32", 3, 2)]


@pytest.mark.parametrize("cell,stage,world", UPSTREAM, ids=[f"upstream-{c}-to-z{s}w{w}" for c, s, w in UPSTREAM])
def test_universal_from_upstream(tmp_path, cell, stage, world):
    source = os.path.join(fixtures.FIXTURES, cell, fixtures.TAG)
    output = str(tmp_path / "t3_universal")
    refused = convert(source, output)
    assert refused.returncode != 0 and "universal_checkpoint_info" in refused.stderr, refused.stderr[-2000:]
    done = convert(source, output, inject=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    trajectory = fixtures.trajectory(cell)
    record = {"at_save": trajectory["at_save"], "global_steps": trajectory["counters"]["global_steps"]}
    client = {"epoch": 7, "note": "upstream fixture"}
    assert run_distributed(load_worker,
                           world,
                           args=(str(tmp_path), "t3_universal", cell, stage, world, record, client),
                           timeout=120) == [True] * world


def test_load_universal_without_latest_universal_raises(tmp_path):
    assert run_distributed(missing_worker, 2, args=(str(tmp_path), ), timeout=60) == [True, True]


def missing_worker(root):
    import deepspeed
    from deepspeed.runtime.checkpoint import CheckpointError
    common.attach_checkpointing()
    config = fixtures.our_config(1, "fp32", False, 2)
    config["checkpoint"] = {"load_universal": True}
    model = fixture_model.build_model(seed=1)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    with pytest.raises(CheckpointError, match="latest_universal"):
        engine.load_checkpoint(root)
    engine.destroy()
    return True


UPSTREAM_PYTHON = os.environ.get("DS_UPSTREAM_PYTHON")
UPSTREAM_CONVERTED = [("z2-fp32", 3, 1), ("z3-bf16", 1, 3)]


@pytest.mark.skipif(not UPSTREAM_PYTHON,
                    reason="set DS_UPSTREAM_PYTHON to an interpreter with upstream DeepSpeed "
                    "(e.g. /work/upstream-venv/bin/python) to load folders written by upstream's own converter")
@pytest.mark.parametrize("cell,stage,world",
                         UPSTREAM_CONVERTED,
                         ids=[f"upstream-converter-{c}-to-z{s}w{w}" for c, s, w in UPSTREAM_CONVERTED])
def test_folder_of_upstream_converter_loads(tmp_path, cell, stage, world):
    """A universal folder written by upstream's ``ds_to_universal`` (stage-3 files are bare tensors there)."""
    output = str(tmp_path / "t3_universal")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(DS_ACCELERATOR="cpu",
               PYTHONWARNINGS="ignore",
               TORCH_EXTENSIONS_DIR=os.environ.get("DS_UPSTREAM_EXTENSIONS_DIR", "/tmp/ext-upstream-tests"))
    done = subprocess.run([
        UPSTREAM_PYTHON, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
        os.path.join(fixtures.FIXTURES, cell, fixtures.TAG), "--output_folder", output, "--inject_missing_state",
        "--num_extract_workers", "1", "--num_merge_workers", "1"
    ],
                          cwd=str(tmp_path),
                          env=env,
                          capture_output=True,
                          text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    trajectory = fixtures.trajectory(cell)
    record = {"at_save": trajectory["at_save"], "global_steps": trajectory["counters"]["global_steps"]}
    client = {"epoch": 7, "note": "upstream fixture"}
    assert run_distributed(load_worker,
                           world,
                           args=(str(tmp_path), "t3_universal", cell, stage, world, record, client),
                           timeout=120) == [True] * world
