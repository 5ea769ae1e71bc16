# SPDX-License-Identifier: Apache-2.0
"""Pipeline and MoE names import from upstream's paths with upstream's constructor parameters; constructing
the pipeline classes raises NotImplementedError pointing to docs/compatibility.md (MoE is built: tests/unit/moe)."""

import inspect

import pytest
import torch

# Parameter names (in order) of upstream's constructors, written out from upstream's signatures.
UPSTREAM_PARAMETERS = {
    "PipelineModule": [
        "layers", "num_stages", "topology", "loss_fn", "seed_layers", "seed_fn", "base_seed", "partition_method",
        "activation_checkpoint_interval", "activation_checkpoint_func", "checkpointable_layers", "dynamic_shape"
    ],
    "LayerSpec": ["typename", "module_args", "module_kwargs"],
    "TiedLayerSpec": ["key", "typename", "module_args", "forward_fn", "tied_weight_attr", "module_kwargs"],
    "MoE": [
        "hidden_size", "expert", "num_experts", "ep_size", "k", "capacity_factor", "eval_capacity_factor",
        "min_capacity", "use_residual", "noisy_gate_policy", "drop_tokens", "use_rts", "use_tutel",
        "enable_expert_tensor_parallelism", "top2_2nd_expert_sampling"
    ],
}


def _classes():
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe import PipelineModule as RuntimePipelineModule
    from deepspeed.runtime.pipe.module import LayerSpec as ModuleLayerSpec
    assert PipelineModule is RuntimePipelineModule is deepspeed.PipelineModule
    assert LayerSpec is ModuleLayerSpec
    assert issubclass(PipelineModule, torch.nn.Module) and issubclass(MoE, torch.nn.Module)
    assert issubclass(TiedLayerSpec, LayerSpec)
    return {"PipelineModule": PipelineModule, "LayerSpec": LayerSpec, "TiedLayerSpec": TiedLayerSpec, "MoE": MoE}


@pytest.mark.parametrize("name", sorted(UPSTREAM_PARAMETERS))
def test_upstream_signature(name):
    cls = _classes()[name]
    assert list(inspect.signature(cls.__init__).parameters)[1:] == UPSTREAM_PARAMETERS[name]


CONSTRUCT = {
    "PipelineModule": lambda c: c(layers=[torch.nn.Linear(2, 2)], num_stages=1),
    "LayerSpec": lambda c: c(torch.nn.Linear, 2, 2),
    "TiedLayerSpec": lambda c: c("embed", torch.nn.Embedding, 4, 2),
}


@pytest.mark.parametrize("name", sorted(CONSTRUCT))
def test_constructing_raises_not_implemented(name):
    with pytest.raises(NotImplementedError, match=r"not supported yet.*docs/compatibility\.md"):
        CONSTRUCT[name](_classes()[name])
