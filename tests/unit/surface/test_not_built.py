# SPDX-License-Identifier: Apache-2.0
"""Names of features this runtime does not build: each imports, and using it raises NotImplementedError that names
the feature (docs/compatibility.md lists them)."""

import importlib

import pytest
import torch

# (module, name, how it is used, words the message must hold)
NOT_BUILT = [
    ("deepspeed.runtime.progressive_layer_drop", "ProgressiveLayerDrop", lambda c: c(theta=0.5, gamma=0.001),
     "progressive layer dropping"),
    ("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload", lambda c: c(torch.nn.Linear(1, 1), None, {}),
     "DeepSpeedZeRoOffload"),
    ("deepspeed.runtime.comm.coalesced_collectives", "all_to_all_quant_reduce", lambda f: f([], {}), "qgZ"),
    ("deepspeed.runtime.zero.partition_parameters", "CUDAQuantizer", lambda c: c(), "qwZ"),
    ("deepspeed.runtime.checkpoint_engine", "DataStatesCheckpointEngine", lambda c: c(), "DataStates"),
    ("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer", lambda c: c(None, None, None), "deepspeed.initialize"),
    ("deepspeed.runtime.fp16.fused_optimizer", "FP16_Optimizer", lambda c: c(None), "deepspeed.initialize"),
    ("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer", lambda c: c(None), "deepspeed.initialize"),
]


@pytest.mark.parametrize("module,name,use,words", NOT_BUILT, ids=[f"{m}.{n}" for m, n, _, _ in NOT_BUILT])
def test_not_built_raises_naming_the_feature(module, name, use, words):
    target = getattr(importlib.import_module(module), name)
    with pytest.raises(NotImplementedError, match=words):
        use(target)


def test_aio_config_defaults():
    from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT, get_aio_config
    assert get_aio_config({}) == AIO_DEFAULT_DICT
    assert get_aio_config({"aio": {"block_size": 4096}})["block_size"] == 4096
