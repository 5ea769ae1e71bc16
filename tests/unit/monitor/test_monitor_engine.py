# SPDX-License-Identifier: Apache-2.0
"""The engine's monitor on 2 gloo ranks: files on rank 0 only, events equal to a plain-torch run at the right steps;
bad monitor configs raise the same clear error on every rank during ``initialize``."""

import os
import sys

import pytest

from tests.unit.common import run_distributed
from tests.unit.monitor import training as T

TIMEOUT_S = 90
STEPS = 3


def monitored_run(root, stage):
    import deepspeed.comm as dist
    rank = dist.get_rank()
    mine = os.path.join(root, f"rank{rank}")  # rank-specific paths show which rank wrote what
    config = T.base_config(zero_optimization={"stage": stage},
                           tensorboard={
                               "enabled": True,
                               "output_path": mine,
                               "job_name": "tb"
                           },
                           csv_monitor={
                               "enabled": True,
                               "output_path": mine,
                               "job_name": "csv"
                           })
    engine = T.train_engine(config, STEPS, rank)
    engine.destroy()
    result = {"files": T.files_under(root) if os.path.isdir(root) else []}
    if rank == 0:
        result["tb"] = T.read_tensorboard_dir(os.path.join(mine, "tb"))
        result["csv"] = T.read_csv_dir(os.path.join(mine, "csv"))
    dist.barrier()
    return result


@pytest.mark.parametrize("stage", [0, 2])
def test_tensorboard_and_csv_hold_the_engines_values(tmp_path, stage):
    rank0, rank1 = run_distributed(monitored_run, 2, args=(str(tmp_path), stage), timeout=TIMEOUT_S)
    assert rank0["files"] == rank1["files"]
    assert rank0["files"] and all(f.startswith("rank0" + os.sep) for f in rank0["files"]), rank0["files"]

    losses, norms, lrs = T.reference_run(STEPS)
    batch = T.MICRO * T.GAS * T.WORLD
    expected = {
        "Train/Samples/train_loss": [(s * batch, v) for s, v in enumerate(losses)],
        "Train/Samples/lr": [((s + 1) * batch, v) for s, v in enumerate(lrs)],
        "Train/Samples/grad_norm": [((s + 1) * batch, v) for s, v in enumerate(norms)],
    }
    assert set(rank0["tb"]) == set(expected), rank0["tb"].keys()
    csv_files = {name.replace("/", "_") + ".csv": name for name in expected}
    assert set(rank0["csv"]) == set(csv_files)
    for tag, want in expected.items():
        got_tb = rank0["tb"][tag]
        header, got_csv = rank0["csv"][tag.replace("/", "_") + ".csv"]
        assert header == ["step", tag.split("/")[-1]]
        for got in (got_tb, got_csv):
            assert [s for s, _ in got] == [s for s, _ in want], (tag, got)
            assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5), (tag, got, want)
    assert all(lr > 0 for lr in lrs) and len(set(lrs)) == STEPS, "the reference must exercise the scheduler"
    assert any(n > T.CLIP for n in norms), "the reference must exercise clipping (the norm is the unclipped one)"


def bad_config_run(kind, root):
    import deepspeed
    import deepspeed.comm as dist
    from tests.unit.monitor.training import base_config, make_model
    sections = {
        "unknown_key": {
            "tensorboard": {
                "enabled": True,
                "outputpath": root
            }
        },
        "wandb_missing": {
            "wandb": {
                "enabled": True
            }
        },
        "unwritable_path": {
            "csv_monitor": {
                "enabled": True,
                "output_path": os.path.join(root, "a_file"),
                "job_name": "job"
            }
        },
        "bad_type": {
            "csv_monitor": {
                "enabled": "yes"
            }
        },
    }[kind]
    saved = sys.modules.get("wandb", None)
    sys.modules["wandb"] = None  # `import wandb` raises ImportError, installed or not
    try:
        deepspeed.initialize(model=make_model(), config=dict(base_config(), optimizer={"type": "SGD"}, **sections))
    except Exception as err:  # every rank must get here
        outcome = (type(err).__name__, str(err))
    else:
        outcome = None
    finally:
        if saved is None:
            del sys.modules["wandb"]
        else:
            sys.modules["wandb"] = saved
    dist.barrier()  # the ranks are still in step
    return outcome


@pytest.mark.parametrize("kind, error, words", [
    ("unknown_key", "DeepSpeedConfigError", ["tensorboard.outputpath", "output_path"]),
    ("bad_type", "DeepSpeedConfigError", ["csv_monitor.enabled", "bool"]),
    ("wandb_missing", "ImportError", ["wandb.enabled", "'wandb' package", "pip install wandb"]),
    ("unwritable_path", "DeepSpeedConfigError", ["csv_monitor.output_path", "a_file"]),
])
def test_bad_monitor_config_raises_on_every_rank(tmp_path, kind, error, words):
    (tmp_path / "a_file").write_text("a regular file: no directory can be made under it")
    outcomes = run_distributed(bad_config_run, 2, args=(kind, str(tmp_path)), timeout=TIMEOUT_S)
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None, f"rank {rank} did not raise"
        name, message = outcome
        assert name == error, (rank, outcome)
        for word in words:
            assert word in message, (rank, message)
    assert not (tmp_path / "job").exists()


def fp16_run(root):
    import deepspeed.comm as dist
    rank = dist.get_rank()
    scales = []
    config = T.base_config(fp16={
        "enabled": True,
        "auto_cast": True,
        "initial_scale_power": 4,
        "loss_scale_window": 2
    },
                           csv_monitor={
                               "enabled": True,
                               "output_path": root,
                               "job_name": "fp16"
                           })
    engine = T.train_engine(config, 4, rank, after_step=lambda e: scales.append(e.get_loss_scale()))
    engine.destroy()
    dist.barrier()
    return scales, (T.read_csv_dir(os.path.join(root, "fp16")) if rank == 0 else None)


def test_fp16_loss_scale_events(tmp_path):
    (scales, csv), _ = run_distributed(fp16_run, 2, args=(str(tmp_path), ), timeout=TIMEOUT_S)
    # Dynamic scaling from 2**4 with a window of 2 and no overflow: doubles after every second step.
    assert scales == [16.0, 32.0, 32.0, 64.0]
    header, rows = csv["Train_Samples_loss_scale.csv"]
    batch = T.MICRO * T.GAS * T.WORLD
    assert header == ["step", "loss_scale"]
    assert rows == [((s + 1) * batch, v) for s, v in enumerate(scales)]
