# SPDX-License-Identifier: Apache-2.0
"""``zero_to_fp32`` on checkpoints written by upstream DeepSpeed: every fixture, the API and the command line.

The consolidated state dict of each upstream fixture has the model's ``state_dict()`` keys in order and, for
every parameter, upstream's own fp32 master at the save (``trajectory.pt``), bitwise;
``load_state_dict_from_zero_checkpoint`` puts those values into a model; the command line writes the same.
"""

import os
import subprocess
import sys

import pytest
import torch

from tests.unit.checkpoint import test_upstream_fixtures as fixtures
from tests.unit.checkpoint.upstream import model as fixture_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize("cell", fixtures.cells())
def test_zero_to_fp32_on_upstream_checkpoint(cell):
    from deepspeed.utils.zero_to_fp32 import (get_fp32_state_dict_from_zero_checkpoint,
                                              load_state_dict_from_zero_checkpoint)
    directory = os.path.join(fixtures.FIXTURES, cell)
    state = get_fp32_state_dict_from_zero_checkpoint(directory)  # the tag from 'latest'
    model = fixture_model.build_model(seed=1)
    assert list(state) == list(model.state_dict())
    expected = fixtures.trajectory(cell)["at_save"]
    for name, entry in expected.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], entry["fp32"]), name
    load_state_dict_from_zero_checkpoint(model, directory, tag=fixtures.TAG)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), expected[name]["fp32"]), name


def test_zero_to_fp32_command_line_on_upstream_checkpoint(tmp_path):
    cell = "z3-bf16"
    out = str(tmp_path / "pytorch_model.bin")
    done = subprocess.run(
        [sys.executable, "-m", "deepspeed.utils.zero_to_fp32",
         os.path.join(fixtures.FIXTURES, cell), out],
        env=dict(os.environ, PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    state = torch.load(out, weights_only=True)
    for name, entry in fixtures.trajectory(cell)["at_save"].items():
        assert torch.equal(state[name], entry["fp32"]), name


def test_copied_script_on_upstream_checkpoint(tmp_path):
    """The ``zero_to_fp32.py`` that ``save_checkpoint`` copies into a checkpoint folder, run as a script."""
    import shutil
    from deepspeed.utils import zero_to_fp32
    script = str(tmp_path / "zero_to_fp32.py")
    shutil.copy(zero_to_fp32.__file__, script)  # what saving._copy_recovery_script puts there
    cell = "z2-fp16-offload"
    out = str(tmp_path / "model.pt")
    done = subprocess.run([sys.executable, script,
                           os.path.join(fixtures.FIXTURES, cell), out, "-t", fixtures.TAG],
                          env=dict(os.environ, PYTHONPATH=REPO),
                          cwd=str(tmp_path),
                          capture_output=True,
                          text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    state = torch.load(out, weights_only=True)
    for name, entry in fixtures.trajectory(cell)["at_save"].items():
        assert torch.equal(state[name], entry["fp32"]), name
