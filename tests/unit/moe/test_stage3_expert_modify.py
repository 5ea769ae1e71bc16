# SPDX-License-Identifier: Apache-2.0
"""``GatheredParameters(modifier_rank=...)`` over experts of expert-parallel size 2 on ZeRO-3 (world 4).

Every rank writes values of its own (seeded by its rank and the parameter) into the gathered dense parameters
and this rank's experts, then the context exits. Dense parameters must hold ``modifier_rank``'s values on every
rank. An expert parameter is held by its expert-data-parallel group (upstream's expert tables,
``_get_expert_parallel_ranks``): it must hold the values of the member of that group at the position
``modifier_rank`` holds in its own group (``modifier_rank`` itself in its group). Checked on the whole values
read back (a gather without modifier) and on the fp32 masters (``safe_get_full_fp32_param``), then one SGD step
from the expected values with the gradient the engine reports must give the engine's masters. Cells:
``modifier_rank`` 1 and 3 (the first and the second member of a group), the 16-bit shards on the host
(``offload_param``) in one.
"""

import torch

from tests.unit.common import run_distributed
from tests.unit.moe.test_moe_contract import D, S, Net

T = 240
EP, LR = 2, 0.1


def _written(rank, index, shape):
    g = torch.Generator().manual_seed(100 * rank + index)
    return torch.randn(shape, generator=g)


def _cell(modifier_rank, offload_param):
    import deepspeed
    from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_grad
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = Net(EP, 1)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": LR
            }
        }
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
        for i, p in enumerate(params):
            p.data.copy_(_written(rank, i, p.shape))
    _, edp_groups = groups._get_expert_parallel_ranks(world, 1, EP)
    mine = next(g for g in edp_groups if rank in g)
    theirs = next(g for g in edp_groups if modifier_rank in g)
    expert_source = mine[theirs.index(modifier_rank)]
    want = {}
    bad = []
    for i, (name, p) in enumerate(named):
        source = expert_source if ".deepspeed_experts." in name else modifier_rank
        want[name] = _written(source, i, p.ds_shape)
        with deepspeed.zero.GatheredParameters([p]):
            if not torch.equal(p.data, want[name]):
                bad.append(f"{name}: gathered value is not rank {source}'s")
        if not torch.equal(safe_get_full_fp32_param(p), want[name]):
            bad.append(f"{name}: fp32 master is not rank {source}'s")
    loss = engine(torch.randn(S, D, generator=torch.Generator().manual_seed(rank)))
    engine.backward(loss)
    grads = {name: safe_get_full_grad(p).clone() for name, p in named}
    engine.step()
    for name, p in named:
        if not torch.allclose(safe_get_full_fp32_param(p), want[name] - LR * grads[name], rtol=1e-6, atol=1e-7):
            bad.append(f"{name}: the step after the modification")
    engine.destroy()
    groups.reset_mesh()
    return bad


def _cells(cells):
    return [(cell, bad[:4]) for cell in cells for bad in [_cell(*cell)] if bad]


def test_modifier_rank_over_experts():
    cells = [(1, True), (3, False)]
    assert run_distributed(_cells, 4, args=(cells, ), timeout=T) == [[]] * 4
