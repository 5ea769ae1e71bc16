# SPDX-License-Identifier: Apache-2.0
"""``engine._zero3_consolidated_16bit_state_dict()`` gives what upstream gives (Transformers ``save_model``).

A ZeRO-3 bf16 model with a non-persistent buffer (a rotary ``inv_freq``), a persistent
buffer, a tied embedding/head weight, a submodule reached under two parents and a frozen
parameter, on 1 and 2 ranks, after two training steps:

* rank 0 gets an ordered dict with exactly the keys of the plain model's ``state_dict()``
  (every name of a tied parameter, no non-persistent buffer), each tied name bound to one
  tensor; every other rank gets None;
* trainable parameters equal their fp32 masters rounded to bf16, the frozen parameter and
  the buffers their initial values (computed without the gather under test);
* ``exclude_frozen_parameters`` leaves the frozen parameter out; ``save_16bit_model`` writes
  the same dict; on a stage 0-2 engine the method raises ValueError on every rank.
"""

import copy

import pytest
import torch
from torch import nn

from tests.unit.common import run_distributed

VOCAB, DIM = 16, 8


class Rotary(nn.Module):

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(1.0, 5.0), persistent=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, h):
        return self.proj(h) * self.scale + self.inv_freq.sum() * 0


class Net(nn.Module):

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.rot = Rotary()
        shared = nn.Linear(DIM, DIM)
        self.body = nn.Sequential(shared, nn.Tanh())
        self.side = nn.Sequential(shared)  # one submodule under two parents
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.rot.proj.bias.requires_grad_(False)

    def forward(self, tokens):
        h = self.rot(self.emb(tokens))
        return self.head(self.body(h) + self.side(h))


def config(stage, gather=True):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 0.05
            }
        },
        "bf16": {
            "enabled": True
        },
        # The buffers enter bf16 arithmetic (h * scale): cast them with the parameters (fp32 buffers stay fp32
        # otherwise, as upstream keeps them).
        "data_types": {
            "buffer_dtype": "bf16"
        },
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 50,
            "stage3_gather_16bit_weights_on_model_save": gather
        },
    }


def consolidated_worker(tmp):
    import deepspeed
    import deepspeed.comm as dist
    import torch.nn.functional as F
    from deepspeed.utils import safe_get_full_fp32_param
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model).to(torch.bfloat16)  # the initial values, and the keys of a plain state dict
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(3))[0]
    for step in range(2):
        gen = torch.Generator().manual_seed(10 * rank + step)
        tokens = torch.randint(0, VOCAB, (2, 3), generator=gen)
        engine.backward(F.cross_entropy(engine(tokens).float().reshape(-1, VOCAB), tokens.reshape(-1)))
        engine.step()
    masters = {n: safe_get_full_fp32_param(p).cpu() for n, p in engine.module.named_parameters() if p.requires_grad}
    state = engine._zero3_consolidated_16bit_state_dict()
    trainable_only = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    assert engine.save_16bit_model(tmp) is True
    engine.destroy()
    if rank != 0:
        assert state is None and trainable_only is None, (type(state), type(trainable_only))
        return True
    expected_keys = list(plain.state_dict().keys())
    assert "rot.inv_freq" not in expected_keys and "head.weight" in expected_keys and "side.0.weight" in expected_keys
    assert list(state.keys()) == expected_keys
    assert list(trainable_only.keys()) == [k for k in expected_keys if k != "rot.proj.bias"]
    assert state["head.weight"] is state["emb.weight"] and state["side.0.weight"] is state["body.0.weight"]
    source = {"head.weight": "emb.weight", "side.0.weight": "body.0.weight", "side.0.bias": "body.0.bias"}
    initial = plain.state_dict()
    for name, value in state.items():
        assert value.device.type == "cpu", name
        name_of_master = source.get(name, name)
        if name_of_master in masters:
            expected = masters[name_of_master].to(torch.bfloat16)
        else:  # frozen parameter and buffers: untouched by training
            expected = initial[name]
        assert value.dtype == expected.dtype and torch.equal(value, expected), name
    saved = torch.load(f"{tmp}/pytorch_model.bin")
    assert list(saved.keys()) == expected_keys
    assert all(torch.equal(saved[k], state[k]) for k in expected_keys)
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_consolidated_16bit_state_dict(tmp_path, world):
    assert run_distributed(consolidated_worker, world, args=(str(tmp_path), ), timeout=60) == [True] * world


def not_stage3_worker():
    import deepspeed
    torch.manual_seed(0)
    model = Net()
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(2))[0]
    with pytest.raises(ValueError, match="stage 3"):
        engine._zero3_consolidated_16bit_state_dict()
    engine.destroy()
    return True


def test_consolidated_needs_stage3():
    assert run_distributed(not_stage3_worker, 2, timeout=60) == [True] * 2
