# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.utils.zero_to_fp32`` rebuilds the fp32 parameters the engine holds, without torch.distributed.

Stages 0, 1, 2 x fp32/bf16 on 2 ranks, with a tied weight and a frozen parameter: the
consolidated state dict has the model's keys in its order, every trainable entry equals
``safe_get_full_fp32_param`` of the engine bitwise, frozen parameters and buffers are
the saved module's, tied names share one tensor. The file, sharded-directory, CLI,
copied-script and ``load_state_dict_from_zero_checkpoint`` paths give the same values.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.unit.checkpoint import test_checkpoint_resume as common
from tests.unit.common import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def save_worker(save_dir, stage, dtype):
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param
    common.attach_checkpointing()
    rank = dist.get_rank()
    engine = common.build_engine(common.make_config(stage, dtype), seed=0, frozen=True, tie=True)
    common.train(engine, 2, 0, rank)
    engine.save_checkpoint(save_dir)
    fp32 = {name: safe_get_full_fp32_param(p).cpu() for name, p in engine.module.named_parameters() if p.requires_grad}
    module = {name: t.detach().cpu().clone() for name, t in engine.module.state_dict().items()}
    engine.destroy()
    return fp32, module


def _check(state_dict, fp32, module, exclude_frozen=False):
    expected_keys = [k for k in module if not (exclude_frozen and k == "block2.bias")]
    assert list(state_dict) == expected_keys
    for name, value in state_dict.items():
        source = "emb.weight" if name == "head.weight" else name
        if source in fp32:
            assert value.dtype == torch.float32 and torch.equal(value, fp32[source]), name
        else:
            assert value.dtype == module[name].dtype and torch.equal(value, module[name]), name
    assert state_dict["head.weight"] is state_dict["emb.weight"]


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero_to_fp32_matches_engine(tmp_path, stage, dtype):
    from deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                              get_fp32_state_dict_from_zero_checkpoint,
                                              load_state_dict_from_zero_checkpoint, main)
    import torch.distributed
    save_dir = str(tmp_path / "ckpt")
    fp32, module = run_distributed(save_worker, 2, args=(save_dir, stage, dtype), timeout=60)[0]
    assert not torch.distributed.is_initialized()

    _check(get_fp32_state_dict_from_zero_checkpoint(save_dir), fp32, module)
    _check(get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="global_step2", exclude_frozen_parameters=True),
           fp32,
           module,
           exclude_frozen=True)

    out_file = str(tmp_path / "out" / "model.bin")
    convert_zero_checkpoint_to_fp32_state_dict(save_dir, out_file)
    _check(torch.load(out_file), fp32, module)

    out_dir = str(tmp_path / "sharded")
    assert main([save_dir, out_dir, "-t", "global_step2", "--max_shard_size", "600B"]) == 0
    with open(os.path.join(out_dir, "pytorch_model.bin.index.json")) as handle:
        index = json.load(handle)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    merged = {}
    for shard in shards:
        merged.update(torch.load(os.path.join(out_dir, shard)))
    assert sorted(merged) == sorted(index["weight_map"]) == sorted(module)
    for name, value in merged.items():
        source = "emb.weight" if name == "head.weight" else name
        assert torch.equal(value, fp32.get(source, module[name]).to(value.dtype)), name

    model = load_state_dict_from_zero_checkpoint(common.build_model(7, frozen=True, tie=True), save_dir)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), fp32.get(name, module[name]).float()), name


def test_copied_script_runs_without_distributed(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    fp32, module = run_distributed(save_worker, 2, args=(save_dir, 2, "bf16"), timeout=60)[0]
    script = os.path.join(save_dir, "zero_to_fp32.py")
    assert os.access(script, os.X_OK), "the copied recovery script is executable, as upstream's"
    out = str(tmp_path / "pytorch_model.bin")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, script, save_dir, out], check=True, cwd=save_dir, env=env, timeout=120)
    _check(torch.load(out), fp32, module)


def test_recovery_script_permissions_on_a_file_system_that_refuses_them(tmp_path, caplog):
    """Upstream's ``engine._change_recovery_script_permissions``: a missing file (or refused chmod) is logged at
    info level and saving goes on."""
    import logging
    from deepspeed.runtime.checkpoint.engine_mixin import CheckpointEngineMixin
    from deepspeed.utils.logging import logger
    logger.propagate, propagate = True, logger.propagate
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            CheckpointEngineMixin._change_recovery_script_permissions(None, str(tmp_path / "missing" / "x.py"))
    finally:
        logger.propagate = propagate
    assert "could not make" in caplog.text
    present = tmp_path / "zero_to_fp32.py"
    present.write_text("")
    CheckpointEngineMixin._change_recovery_script_permissions(None, str(present))
    assert os.access(present, os.X_OK)
