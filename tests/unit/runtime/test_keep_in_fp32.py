# SPDX-License-Identifier: Apache-2.0
"""``data_types.keep_in_fp32_modules``: the buffers a model names stay fp32 under bf16/fp16 training (upstream
0.19.8's semantics: buffers only; ``"auto"`` reads transformers' ``_keep_in_fp32_modules_strict`` /
``_keep_in_fp32_modules``; a list gives ``*`` patterns searched in the full buffer names).

Reference: the same model cast by hand in plain torch (parameters to the 16-bit dtype, every other floating buffer
to ``buffer_dtype``, the named ones kept fp32); dtypes and outputs must be equal, bitwise.
"""

import copy

import pytest
import torch

from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.config_utils import DeepSpeedConfigError
from deepspeed.runtime.keep_in_fp32 import keep_in_fp32_pattern
from tests.unit.common import run_distributed


class Router(torch.nn.Module):
    """Scores in the training dtype; the correction bias added in fp32 decides the expert (values 1e-3 apart near
    10, which bf16 cannot tell apart)."""

    def __init__(self, width=6, experts=8):
        super().__init__()
        self.gate = torch.nn.Linear(width, experts)
        self.register_buffer("e_score_correction_bias", 10.0 + 1e-3 * torch.arange(experts, dtype=torch.float32))
        self.register_buffer("scale", torch.full((experts, ), 0.5))

    def forward(self, x):
        scores = self.gate(x).float() * 1e-3 + self.e_score_correction_bias * self.scale.float()
        return scores, scores.argmax(-1)


class Model(torch.nn.Module):
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]
    _keep_in_fp32_modules = ["scale"]  # fp16 only

    def __init__(self):
        super().__init__()
        self.router = Router()

    def forward(self, x):
        return self.router(x)


def _reference(model, dtype, buffer_dtype, kept):
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for param in ref.parameters():
            param.data = param.data.to(dtype)
        for name, buffer in ref.named_buffers():
            if name in kept:
                buffer.data = buffer.data.float()
            elif buffer_dtype is not None:
                buffer.data = buffer.data.to(buffer_dtype)
    return ref


def _engine(precision, data_types, seed):
    import deepspeed
    torch.manual_seed(seed)
    model = Model()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    config = {"train_micro_batch_size_per_gpu": 2, precision: {"enabled": True}, "data_types": data_types}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    dtypes = {name: b.dtype for name, b in engine.module.named_buffers()}
    x = torch.randn(5, 6).to(dtype)
    scores, choice = engine(x)
    engine.destroy()
    return dtypes, scores, choice, x


@pytest.mark.parametrize(
    "precision,data_types,kept",
    [
        ("bf16", {"buffer_dtype": "bf16"}, {"router.e_score_correction_bias"}),  # auto: the strict list
        ("fp16", {"buffer_dtype": "fp16"}, {"router.e_score_correction_bias", "router.scale"}),  # and the fp16 list
        ("bf16", {"buffer_dtype": "bf16", "keep_in_fp32_modules": ["*scale"]}, {"router.scale"}),
        ("bf16", {"buffer_dtype": "bf16", "keep_in_fp32_modules": []}, set()),
    ])  # yapf: disable
def test_named_buffers_stay_fp32(precision, data_types, kept):
    (dtypes, scores, choice, x), = run_distributed(_engine, 1, args=(precision, data_types, 3), timeout=120)
    torch.manual_seed(3)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    ref = _reference(Model(), dtype, dtype, kept)
    assert dtypes == {name: b.dtype for name, b in ref.named_buffers()}
    assert {name for name, d in dtypes.items() if d == torch.float32} == kept
    ref_scores, ref_choice = ref(x)
    assert torch.equal(scores, ref_scores) and torch.equal(choice, ref_choice)


def test_kept_bias_decides_routing():
    """Why the key exists: the bias cast to bf16 loses the differences that pick the expert."""
    torch.manual_seed(5)
    model = Model()
    kept = _reference(model, torch.bfloat16, torch.bfloat16, {"router.e_score_correction_bias"})
    lost = _reference(model, torch.bfloat16, torch.bfloat16, set())
    x = torch.randn(16, 6).bfloat16()
    assert kept.router.e_score_correction_bias.unique().numel() == 8
    assert lost.router.e_score_correction_bias.unique().numel() < 8
    assert not torch.equal(kept(x)[1], lost(x)[1])


def test_pattern_rules():
    model = Model()
    assert keep_in_fp32_pattern(model, "auto", torch.float32) is None  # fp32 training: nothing to keep
    pattern = keep_in_fp32_pattern(model, "auto", torch.bfloat16)
    assert pattern.search("router.e_score_correction_bias") and not pattern.search("router.scale")
    assert keep_in_fp32_pattern(model, [], torch.bfloat16) is None
    glob = keep_in_fp32_pattern(model, ["router.*bias"], torch.float16)
    assert glob.search("router.e_score_correction_bias") and not glob.search("router.scale")


def test_config_values():
    base = {"train_batch_size": 2, "bf16": {"enabled": True}}
    assert DeepSpeedConfig(base, world_size=1).keep_in_fp32_modules == "auto"
    given = DeepSpeedConfig(dict(base, data_types={"keep_in_fp32_modules": ["a*"]}), world_size=1)
    assert given.keep_in_fp32_modules == ["a*"]
    with pytest.raises(DeepSpeedConfigError, match="keep_in_fp32_modules"):
        DeepSpeedConfig(dict(base, data_types={"keep_in_fp32_modules": "everything"}), world_size=1)
