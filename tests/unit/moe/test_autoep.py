# SPDX-License-Identifier: Apache-2.0
"""AutoEP: a rank whose experts get no token, bad input, the optimizer following the replaced experts.

The training cells (every preset's tiny HF model against the unsharded model in plain torch, ep 1,
2 and 4, ZeRO 0-2) are in test_autoep_presets.py. A block whose experts on one rank receive no
token in a micro-step is checked here through a one-block model whose router is steered. Bad
inputs raise on every rank before any collective.
"""

import copy

import pytest
import torch

from tests.unit.common import run_distributed

T = 300


def _mixtral():
    from tests.unit.moe.autoep_models import mixtral
    return mixtral()


def _qwen3():
    from tests.unit.moe.autoep_models import qwen3_moe
    return qwen3_moe()


class _OneBlock(torch.nn.Module):
    """A Mixtral sparse block alone, router steered by feature 0 (experts 0, 1 for large positive values)."""

    def __init__(self):
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        super().__init__()
        self.config = MixtralConfig(hidden_size=8, intermediate_size=4, num_local_experts=4, num_experts_per_tok=2)
        torch.manual_seed(5)
        self.block = MixtralSparseMoeBlock(self.config)
        with torch.no_grad():
            self.block.gate.weight.normal_()
            self.block.gate.weight[:, 0] = torch.tensor([1.0, 1.0, -1.0, -1.0])
            self.block.experts.gate_up_proj.normal_(0, 0.5)
            self.block.experts.down_proj.normal_(0, 0.5)

    def forward(self, x):
        return self.block(x).square().mean()


def _empty_experts(stage):
    import deepspeed
    from deepspeed.utils import groups, safe_get_full_grad
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    reference = _OneBlock()
    model = copy.deepcopy(reference)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": stage
        },
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.0
            }
        },
        "expert_parallel": {
            "enabled": True,
            "autoep_size": 2
        }
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(2)
    data = [[torch.randn(1, 5, 8, generator=g) for _ in range(world)] for _ in range(2)]
    for x in data[1]:
        x[..., 0] = 30.0  # micro-step 1: every token to experts 0 and 1 (ep rank 0)
    got = None
    for micro in range(2):
        engine.backward(engine(data[micro][rank]))
        if micro == 1:
            got = {n: safe_get_full_grad(p) for n, p in model.named_parameters()}
        engine.step()
    experts = model.block.experts
    first, local = experts.first_expert, experts.num_local_experts
    engine.destroy()
    groups.reset_mesh()
    ref = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for micro in range(2):
        for r in range(world):
            reference.zero_grad()
            if micro == 1:
                _, _, idx = reference.block.gate(data[micro][r].reshape(-1, 8))
                assert int(idx.max()) < 2
            reference(data[micro][r]).backward()
            for n, p in reference.named_parameters():
                ref[n] += p.grad / (world * 2)
    bad = []
    for n, grad in got.items():
        want = ref[n][first:first + local] if "experts" in n else ref[n]
        if not torch.allclose(grad, want, rtol=1e-5, atol=1e-6):
            bad.append(n)
    return bad


@pytest.mark.parametrize("stage", [0, 2])
def test_rank_whose_experts_get_no_tokens(stage):
    assert run_distributed(_empty_experts, 2, args=(stage, ), timeout=T) == [[], []]


def _bad(kind):
    import deepspeed
    model = _mixtral()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "expert_parallel": {
            "enabled": True,
            "autoep_size": 2
        }
    }
    if kind == "preset":
        config["expert_parallel"]["preset_model"] = "qwen3_moe"
    elif kind == "ep_world":
        from tests.unit.moe.autoep_models import mixtral
        model = mixtral(experts=8)
        config["expert_parallel"]["autoep_size"] = 4
    elif kind == "num_experts":
        config["expert_parallel"]["autoep_size"] = 3
    elif kind == "key":
        config["expert_parallel"]["autoep_sise"] = 2
    try:
        deepspeed.initialize(model=model, config=config)
    except (ValueError, NotImplementedError) as err:
        return type(err).__name__ + ": " + str(err)
    return "no error"


@pytest.mark.parametrize("kind, match", [("preset", "does not match"), ("ep_world", "divide the world"),
                                         ("num_experts", "divide the model's number of experts"),
                                         ("key", "unknown config key")])
def test_bad_input_errors_on_every_rank(kind, match):
    results = run_distributed(_bad, 2, args=(kind, ), timeout=T)
    assert results[0] == results[1] and match in results[0], results


def test_remap_follows_identity_not_a_recycled_id():
    from deepspeed.moe.autoep import remap_params
    old, new, other = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    replaced = {id(old): (old, new)}
    assert remap_params([old, other], replaced) == [new, other]
    # an id the table names, held by another object (the old one was freed and its id reused)
    assert remap_params([other], {id(other): (old, new)}) == [other]
    groups = remap_params([{"params": [old], "lr": 0.1}], replaced)
    assert groups[0]["params"] == [new] and groups[0]["lr"] == 0.1


def _generator_and_client_optimizer(kind):
    import deepspeed
    from deepspeed.utils import groups
    model = _qwen3()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 2
        },
        "expert_parallel": {
            "enabled": True,
            "autoep_size": 2
        }
    }
    if kind == "generator":
        config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        client = torch.optim.SGD(model.parameters(), lr=0.1)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config)
    names = {id(p): n for n, p in model.named_parameters()}
    stepped = [names.get(id(p), "?") for p in engine._stage.params]  # what the gradient pipeline owns
    engine.destroy()
    groups.reset_mesh()
    return len(stepped) == len(set(stepped)) == len(names) and "?" not in stepped


@pytest.mark.parametrize("kind", ["generator", "client"])
def test_optimizer_follows_the_replaced_experts(kind):
    assert run_distributed(_generator_and_client_optimizer, 2, args=(kind, ), timeout=T) == [True, True]


@pytest.mark.parametrize("experts,ffn,hidden", [(8, 128, 64), (3, 1, 5), (1, 7, 2), (4, 64, 128)])
def test_fused_expert_layouts(experts, ffn, hidden):
    """Both fused layouts are told apart from the shapes alone; shapes that fit neither give None."""
    from deepspeed.moe.fused_expert_layout import classify_fused_gate_up_layout
    first = classify_fused_gate_up_layout((experts, 2 * ffn, hidden), (experts, hidden, ffn))
    assert (first.layout, first.hidden_size, first.ffn_hidden_size, first.needs_transpose) == \
        ("gate_up_first", hidden, ffn, False)
    second = classify_fused_gate_up_layout((experts, hidden, 2 * ffn), (experts, ffn, hidden))
    assert (second.layout, second.hidden_size, second.ffn_hidden_size, second.needs_transpose) == \
        ("hidden_first", hidden, ffn, True)
    assert classify_fused_gate_up_layout((experts, 2 * ffn + 1, hidden), (experts, hidden, ffn)) is None
    assert classify_fused_gate_up_layout((experts + 1, 2 * ffn, hidden), (experts, hidden, ffn)) is None
    assert classify_fused_gate_up_layout((2 * ffn, hidden), (hidden, ffn)) is None


def test_autoep_refuses_experts_stored_hidden_first():
    """AutoEP computes [E, 2F, H] / [E, H, F] experts; the transposed layout raises naming it rather than being
    multiplied the wrong way round (with H == 2F it would run)."""
    from deepspeed.moe.autoep import GroupedExperts

    class HiddenFirst(torch.nn.Module):

        def __init__(self, experts=4, hidden=8, ffn=4):
            super().__init__()
            self.num_experts, self.hidden_dim, self.intermediate_dim = experts, hidden, ffn
            self.act_fn = torch.nn.SiLU()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(experts, hidden, 2 * ffn))
            self.down_proj = torch.nn.Parameter(torch.zeros(experts, ffn, hidden))

    with pytest.raises(NotImplementedError, match="hidden_first"):
        GroupedExperts(HiddenFirst(), ep_size=1, ep_rank=0)
