# SPDX-License-Identifier: Apache-2.0
"""Upstream's internal names that downstream code and tests reach, provided as views of this runtime's state:
the engine's precision-cast helpers, ``engine.log_level()``, ``utils.timer.trim_mean``."""

from types import SimpleNamespace

import pytest
import torch

from deepspeed.runtime.engine import DeepSpeedEngine
from tests.unit.common import run_distributed


def _stand_in(param_dtype=None, buffer_dtype=None, fp16=False, bf16=False, module=None):
    return SimpleNamespace(_config=SimpleNamespace(param_dtype=param_dtype, buffer_dtype=buffer_dtype),
                           fp16_enabled=lambda: fp16,
                           bfloat16_enabled=lambda: bf16,
                           module=module)


def _with_buffer():
    module = torch.nn.Sequential(torch.nn.Linear(3, 3))
    module.register_buffer("inv_freq", torch.linspace(0.1, 1.0, 3))
    module.register_buffer("steps", torch.arange(3))
    return module


@pytest.mark.parametrize("fp16,bf16,buffer_dtype,expected", [
    (False, True, None, (torch.bfloat16, None)),
    (True, False, "fp32", (torch.float16, torch.float32)),
    (False, False, None, (None, None)),
    (False, True, torch.float16, (torch.bfloat16, torch.float16)),
])
def test_mixed_precision_dtypes(fp16, bf16, buffer_dtype, expected):
    engine = _stand_in(buffer_dtype=buffer_dtype, fp16=fp16, bf16=bf16)
    assert DeepSpeedEngine._mixed_precision_dtypes(engine) == expected


@pytest.mark.parametrize("param_dtype,fp16,bf16,ok", [(None, False, True, True), ("bf16", False, True, True),
                                                      (torch.float32, False, False, True),
                                                      ("fp16", False, True, False), ("fp32", False, True, False),
                                                      ("bf16", True, False, False), ("bf16", False, False, False)])
def test_param_dtype_must_match_the_precision_section(param_dtype, fp16, bf16, ok):
    engine = _stand_in(param_dtype=param_dtype, fp16=fp16, bf16=bf16)
    if ok:
        DeepSpeedEngine._assert_valid_mixed_precision_config(engine)
    else:
        with pytest.raises(AssertionError, match="param_dtype"):
            DeepSpeedEngine._assert_valid_mixed_precision_config(engine)


@pytest.mark.parametrize("param_dtype,buffer_dtype,zero_init,expected", [
    (torch.bfloat16, None, False, (torch.bfloat16, torch.float32)),
    (torch.bfloat16, "bf16", False, (torch.bfloat16, torch.bfloat16)),
    (torch.bfloat16, None, True, (torch.float32, torch.float32)),
    (None, torch.float16, False, (torch.float32, torch.float16)),
])
def test_cast_module_mixed_precision(param_dtype, buffer_dtype, zero_init, expected):
    module = _with_buffer()
    reference = {name: t.detach().clone() for name, t in module.state_dict().items()}
    DeepSpeedEngine._cast_module_mixed_precision(_stand_in(module=module), param_dtype, buffer_dtype, zero_init)
    assert (module[0].weight.dtype, module.inv_freq.dtype) == expected
    assert module.steps.dtype == torch.int64  # integer buffers never change
    for name, tensor in module.state_dict().items():  # a cast, nothing else: the values round as .to() does
        assert torch.equal(tensor, reference[name].to(tensor.dtype)), name


def test_cast_keeps_buffers_that_match_the_keep_pattern_in_fp32():
    import re
    module = _with_buffer()
    module.inv_freq.data = module.inv_freq.data.to(torch.bfloat16)
    DeepSpeedEngine._cast_module_mixed_precision(_stand_in(module=module), torch.bfloat16, torch.bfloat16, False,
                                                 re.compile("inv_freq"))
    assert module.inv_freq.dtype == torch.float32 and module[0].weight.dtype == torch.bfloat16


def conflicting_param_dtype_worker(param_dtype):
    import deepspeed
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "data_types": {"param_dtype": param_dtype},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}  # yapf: disable
    try:
        engine = deepspeed.initialize(model=torch.nn.Linear(2, 2), config=cfg)[0]
    except AssertionError as err:
        return str(err)
    dtype = str(engine.module.weight.dtype)
    engine.destroy()
    return dtype


def test_initialize_refuses_a_param_dtype_the_precision_section_contradicts():
    refused, accepted = run_distributed(conflicting_param_dtype_worker, 1, args=("fp16", ), timeout=60)[0], \
        run_distributed(conflicting_param_dtype_worker, 1, args=("bf16", ), timeout=60)[0]
    assert "data_types.param_dtype=torch.float16 conflicts" in refused and "bf16 enabled" in refused, refused
    assert accepted == "torch.bfloat16"


def test_engine_log_level_reads_the_config():
    """``engine.log_level()`` is the config's ``log_level`` as written (None when unset), read from the parsed
    config (code that stands in a namespace for the engine's config, as upstream's tests do, works too)."""
    import types

    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine
    holder = types.SimpleNamespace(_config=types.SimpleNamespace(log_level="ERROR"))
    assert DeepSpeedEngine.log_level(holder) == "ERROR"
    for written in ("info", "WARNING", None):
        raw = {"train_batch_size": 1} if written is None else {"train_batch_size": 1, "log_level": written}
        engine = types.SimpleNamespace(_config=DeepSpeedConfig(raw))
        assert DeepSpeedEngine.log_level(engine) == written
