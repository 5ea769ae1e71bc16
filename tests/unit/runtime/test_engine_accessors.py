# SPDX-License-Identifier: Apache-2.0
"""The engine's config accessors return what upstream 0.19.8's return for the same config.

The fixture ``engine_accessors_upstream.json`` holds a corpus of real configs (HF Trainer's "auto" templates
after the Trainer filled them, OpenRLHF's training and evaluation configs, Megatron-DeepSpeed's examples) and, for
each, upstream's value of every config accessor, recorded with upstream installed
(``tests/upstream/record_engine_accessors.py``). Here an engine is built from each config (world of one, a small
model) and every accessor must give the same value (for a section object: the same value of every key upstream's
has).
"""

import json
import os

import pytest
import torch

from tests.unit.common import run_distributed
from tests.upstream.record_engine_accessors import ACCESSORS, normalise

# Fields of upstream's section objects for features not built here: setting them raises naming the key
# (tests/unit/runtime/test_config.py), so the object holds no such field.
NOT_BUILT_FIELDS = {
    "tensor_parallel_config.vocab_parallel_lm_head", "tensor_parallel_config.vocab_parallel_ce_backend"
}

FIXTURE = os.path.join(os.path.dirname(__file__), "engine_accessors_upstream.json")
CONFIGS = json.load(open(FIXTURE))["configs"]


def _differences(ours, theirs, path):
    if isinstance(theirs, dict):
        if not isinstance(ours, dict):
            return [f"{path}: {ours!r} != {theirs!r}"]
        return [
            d for key in theirs if f"{path}.{key}" not in NOT_BUILT_FIELDS
            for d in _differences(ours.get(key, "<missing>"), theirs[key], f"{path}.{key}")
        ]
    if isinstance(theirs, float) or isinstance(ours, float):
        return [] if ours == theirs else [f"{path}: {ours!r} != {theirs!r}"]
    return [] if ours == theirs and type(ours) is type(theirs) else [f"{path}: {ours!r} != {theirs!r}"]


def accessor_differences(config, expected):
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    engine = deepspeed.initialize(model=model, config=config)[0]
    try:
        found = []
        for name in ACCESSORS:
            attr = getattr(engine, name)
            found += _differences(normalise(attr() if callable(attr) else attr), expected[name], name)
        return found
    finally:
        engine.destroy()


@pytest.mark.parametrize("entry", CONFIGS, ids=[c["name"] for c in CONFIGS])
def test_accessors_match_upstream(entry):
    assert run_distributed(accessor_differences, 1, args=(entry["config"], entry["upstream"]), timeout=120) == [[]]


def test_not_built_fields_are_refused():
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    for field in NOT_BUILT_FIELDS:
        key = field.split(".")[1]
        with pytest.raises(DeepSpeedConfigError, match=key):
            DeepSpeedConfig({"train_batch_size": 1, "tensor_parallel": {key: "torch"}})
