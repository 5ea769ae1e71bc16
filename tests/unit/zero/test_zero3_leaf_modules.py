# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3 leaf modules: ``deepspeed.utils.set_z3_leaf_modules`` and friends, and what a leaf does in an engine.

* the API, as upstream: classes (subclasses too) or class names, the modules flagged are
  returned, ValueError when nothing matches (unless ``raise_if_not_found=False``), by
  module name and name suffix, ``z3_leaf_module``, ``get_z3_leaf_modules``,
  ``unset_z3_leaf_modules``, and the ``zero_optimization.leaf_module`` config section;
* in a stage-3 engine on 2 ranks, with a mixture of experts whose router sends tokens to
  different experts on each rank: the leaf's whole subtree is one unit (``z3_leaf_parameter``
  on its parameters), no module inside it has a hook, the unit is gathered once per forward
  and once per backward on every rank alike whichever experts ran, and it is released once
  its backward is over (before the backward of the modules in front of it). The gradients
  and weights of the same model match plain torch in ``tests/unit/contract`` (``moe_leaf``).
"""

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.contract.models import MoENet, TinyMoE, lm_loss, make_batch


class RenamedMoE(TinyMoE):
    pass


def test_leaf_api():
    from deepspeed.utils import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                                 set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module,
                                 z3_leaf_parameter)
    model = MoENet()
    assert get_z3_leaf_modules(model) == [] and not z3_leaf_module(model.moe)
    assert set_z3_leaf_modules(model, [TinyMoE]) == [model.moe]
    assert z3_leaf_module(model.moe) and get_z3_leaf_modules(model) == [model.moe]
    assert not z3_leaf_parameter(model.moe.gate.weight)  # marked when an engine is built
    assert unset_z3_leaf_modules(model, [TinyMoE]) == [model.moe] and get_z3_leaf_modules(model) == []
    for name in ("TinyMoE", f"{TinyMoE.__module__}.TinyMoE"):  # class names, bare or qualified
        assert set_z3_leaf_modules(model, [name]) == [model.moe]
        unset_z3_leaf_modules(model, [name])
    model.moe = RenamedMoE()
    assert set_z3_leaf_modules(model, [TinyMoE]) == [model.moe]  # a subclass matches its base class
    unset_z3_leaf_modules(model, [TinyMoE])
    with pytest.raises(ValueError, match="Linear3d"):
        set_z3_leaf_modules(model, ["Linear3d"])
    assert set_z3_leaf_modules(model, ["Linear3d"], raise_if_not_found=False) == []
    with pytest.raises(ValueError, match="classes or class names"):
        set_z3_leaf_modules(model, [3])
    modules, missing = set_z3_leaf_modules_by_name(model, ["moe", "nowhere"], raise_if_not_found=False)
    assert modules == [model.moe] and missing == ["nowhere"]
    with pytest.raises(ValueError, match="nowhere"):
        set_z3_leaf_modules_by_name(model, ["nowhere"])
    modules, missing = set_z3_leaf_modules_by_suffix(model, ["experts.1"], raise_if_not_found=False)
    assert modules == [model.moe.experts[1]] and missing == []
    assert set(map(id, get_z3_leaf_modules(model))) == {id(model.moe), id(model.moe.experts[1])}


@pytest.mark.parametrize("section,expected", [({
    "classes": ["TinyMoE"]
}, ["moe"]), ({
    "names": ["moe"]
}, ["moe"]), ({
    "name_suffixes": ["experts.1"]
}, ["moe.experts.1"]), ({}, [])])
def test_leaf_module_config(section, expected):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, get_zero_config
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES
    # upstream's section holds lists (a single string is a one-element list; repeats dropped)
    assert DeepSpeedZeroConfig().leaf_module.classes == DEFAULT_LEAF_MODULE_CLASSES
    given = DeepSpeedZeroConfig(leaf_module={"classes": "my.Class", "names": ["a", "a"]}).leaf_module
    assert (given.classes, given.names, given.name_suffixes) == (["my.Class"], ["a"], [])
    from deepspeed.utils.z3_leaf_module import apply_zero_leaf_module_config
    model = MoENet()
    cfg = get_zero_config({"zero_optimization": {"stage": 3, "leaf_module": section}})
    flagged = apply_zero_leaf_module_config(model, cfg.leaf_module)
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(m)] for m in flagged] == expected


STAGE3 = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {
        "type": "SGD",
        "params": {
            "lr": 0.1
        }
    },
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 100
    }
}


def lifetimes_worker(by_config):
    import copy
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import set_z3_leaf_modules, z3_leaf_parameter
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MoENet()
    config = copy.deepcopy(STAGE3)
    if by_config:
        config["zero_optimization"]["leaf_module"] = {"classes": ["TinyMoE"]}
    else:
        set_z3_leaf_modules(model, [TinyMoE])
    engine = deepspeed.initialize(model=model, config=config)[0]
    stage = engine._stage
    leaf_units = [u for u in stage.units if u.leaf is not None]
    assert len(leaf_units) == 1 and leaf_units[0].leaf is model.moe, [u.leaf for u in stage.units]
    leaf = leaf_units[0]
    assert {id(p) for p in leaf.params} == {id(p) for p in model.moe.parameters()}
    assert all(z3_leaf_parameter(p) for p in model.moe.parameters())
    assert not any(z3_leaf_parameter(p) for n, p in model.named_parameters() if not n.startswith("moe."))
    assert model.moe._forward_pre_hooks and model.moe._forward_hooks
    inside = [
        n for n, m in model.moe.named_modules() if m is not model.moe and (m._forward_pre_hooks or m._forward_hooks)
    ]
    assert not inside, f"modules inside the leaf have hooks: {inside}"

    launches = []
    launch = stage.coordinator._launch_gather

    def counting_launch(unit, *phase):
        launches.append(unit.index)
        return launch(unit, *phase)

    stage.coordinator._launch_gather = counting_launch
    released_in_backward = []

    def watch_emb(module, inputs, output):
        # emb's output gradient arrives after the backward of everything after it, moe included
        def check(grad):
            released_in_backward.append(
                all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in model.moe.parameters()))

        if output.requires_grad:
            output.register_hook(check)

    model.emb.register_forward_hook(watch_emb)
    used, per_step = [], []
    for step in range(4):
        tokens, targets = make_batch(rank, step)
        launches.clear()
        engine.backward(lm_loss(engine(tokens), targets))
        used.append(list(model.moe.last_used))
        per_step.append(launches.count(leaf.index))
        engine.step()
    engine.destroy()
    assert per_step == [2] * 4, per_step  # once at its forward, once for its backward
    assert released_in_backward == [True] * 4, released_in_backward
    return used


@pytest.mark.parametrize("by_config", [False, True])
def test_leaf_unit_lifetimes(by_config):
    used = run_distributed(lifetimes_worker, 2, args=(by_config, ), timeout=60)
    # the routing really differs: some step runs an expert on one rank and not on the other
    assert any(set(a) != set(b) for a, b in zip(*used)), used


class TwoLayer(torch.nn.Module):
    """Its first op takes the input directly: the input's gradient and the first weight's come from one node."""

    def __init__(self, dim=6):
        super().__init__()
        self.first = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.second = torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def leaf_fed_by_autograd_leaf_worker(requires_grad):
    import copy
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_grad, set_z3_leaf_modules
    torch.manual_seed(0)
    model = TwoLayer()
    reference = copy.deepcopy(model)
    set_z3_leaf_modules(model, [TwoLayer])  # the whole model is the leaf: nothing runs after its backward
    engine = deepspeed.initialize(model=model, config={**STAGE3, "gradient_clipping": 0.0})[0]
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1)
    inputs = torch.randn(world, 3, 6)
    x = inputs[rank].clone().requires_grad_(requires_grad)  # an autograd leaf when it requires grad
    engine.backward(engine(x).square().sum())
    got = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
    x_ref = inputs.clone().requires_grad_(requires_grad)
    sum(reference(x_ref[r]).square().sum() for r in range(world)).div(world).backward()
    x_ok = not requires_grad or torch.allclose(x.grad, x_ref.grad[rank] * world, atol=1e-5)
    engine.destroy()
    return x_ok and all(
        torch.allclose(got[n], p.grad, atol=1e-5) for n, p in reference.named_parameters() if p.grad is not None)


@pytest.mark.parametrize("requires_grad", [True, False])
def test_leaf_fed_by_an_input_that_requires_grad(requires_grad):
    """A leaf whose input is an autograd leaf tensor (created with requires_grad=True): its unit stays gathered
    until every parameter gradient of the leaf is delivered (the input's own gradient may arrive first), and the
    gradients are plain torch's; the input's gradient is the local one (the loss of this rank)."""
    assert run_distributed(leaf_fed_by_autograd_leaf_worker, 2, args=(requires_grad, ), timeout=60) == [True] * 2
