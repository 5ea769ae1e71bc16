# SPDX-License-Identifier: Apache-2.0
"""Pipeline and MoE names import from upstream's paths with upstream's constructor parameters (both are built:
tests/unit/runtime/pipe and tests/unit/moe)."""

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


def test_pipeline_classes_construct_on_one_process():
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    spec = LayerSpec(torch.nn.Linear, 2, 2)
    assert isinstance(spec.build(), torch.nn.Linear) and spec.module_args == (2, 2)
    tied = TiedLayerSpec("embed", torch.nn.Embedding, 4, 2, tied_weight_attr="weight")
    assert tied.tied_weight_attr == ["weight"] and tied.key == "embed"
    model = PipelineModule(layers=[spec, torch.nn.ReLU()], num_stages=1)
    assert model.parts == [0, 2] and model(torch.ones(3, 2)).shape == (3, 2)
