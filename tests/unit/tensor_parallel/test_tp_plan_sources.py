# SPDX-License-Identifier: Apache-2.0
"""The Hugging Face ``tp_plan`` as AutoTP reads it: the config's base plan, the class's and the instance's plans
merged, a copy of a rule under the base model's prefix left out (the shorter pattern already matches every path it
does), and a plan with a style AutoTP does not apply refused as a whole, the style named."""

import re

import pytest

from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan


class _Config:
    base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}


class _Model:
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, runtime_plan):
        self.config = _Config()
        if runtime_plan is not None:
            self._tp_plan = runtime_plan


@pytest.mark.parametrize("runtime_plan", [
    None,
    {
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise"
    },
    {
        "layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "lm_head": "colwise_gather_output"
    },
])
def test_prefixed_copies_are_left_out(runtime_plan):
    assert _get_hf_tp_plan(_Model(runtime_plan)) == {**_Config.base_model_tp_plan, "lm_head": "colwise_gather_output"}


def test_prefixed_copy_would_match_nothing_new():
    """What justifies leaving the copy out: every parameter path its rule matches, the shorter one matches first."""
    short, prefixed = (re.compile(TPPlanConverter._wildcard_to_regex(p) + r"\.weight$")
                       for p in ("layers.*.q_proj", "model.layers.*.q_proj"))
    for path in ("model.layers.0.q_proj.weight", "transformer.model.layers.11.q_proj.weight",
                 "layers.3.q_proj.weight"):
        assert bool(short.search(path)) >= bool(prefixed.search(path))
    assert _get_hf_tp_plan(object()) is None


def test_a_plan_with_an_unsupported_style_is_refused_whole():
    with pytest.raises(ValueError, match=r"unsupported partition style.*local_colwise"):
        TPPlanConverter.convert({"layers.*.q_proj": "local_colwise", "layers.*.o_proj": "rowwise"})
    specs = TPPlanConverter.convert({"layers.*.q_proj": "colwise", "layers.*.o_proj": "rowwise"})
    assert [s.partition_type.name for s in specs] == ["COLUMN", "ROW"]
