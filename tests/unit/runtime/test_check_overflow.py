# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.runtime.utils.CheckOverflow`` agrees over every rank its gradients span, as the engine's skip does.

On 2 gloo ranks, each case gives every rank its own gradients (a NaN or an infinity on one rank only, or none) and
asks every entry point of the utility (``check()``, ``check(param_groups)``, ``has_overflow``,
``check_using_norm`` with upstream's ``-1`` marker and ``reduce_overflow=False``). The expectation is computed
in plain torch from every rank's gradients: an overflow anywhere is an overflow on every rank. Cases: a dense
parameter, an expert parameter of expert-parallel size 2 (upstream's own case), and an ``mpu`` whose model-parallel
group is one rank. The engine's own decision is checked on the same shape of fault: an infinity in one expert's
gradient on one rank skips the ZeRO-2 bf16 step on both ranks.
"""

import torch

from tests.unit.common import run_distributed

INF, NAN = float("inf"), float("nan")
# case -> (dense gradient of rank 0, of rank 1), (expert gradient of rank 0, of rank 1)
CASES = {
    "finite": (([1.0, 2.0], [3.0, 4.0]), ([1.0], [2.0])),
    "dense_inf_rank1": (([1.0, 2.0], [INF, 4.0]), ([1.0], [2.0])),
    "dense_nan_rank0": (([NAN, 2.0], [3.0, 4.0]), ([1.0], [2.0])),
    "expert_inf_rank1": (([1.0, 2.0], [3.0, 4.0]), ([1.0], [INF])),
    "expert_nan_rank0": (([1.0, 2.0], [3.0, 4.0]), ([NAN], [2.0])),
}


class _Mpu:
    """An mpu of upstream's shape: the data-parallel group is the world, the model-parallel group this rank."""

    def __init__(self):
        import torch.distributed as dist
        self.world = dist.group.WORLD
        self.own = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]

    def get_data_parallel_group(self):
        return self.world

    def get_model_parallel_group(self):
        return self.own

    def get_data_parallel_world_size(self):
        return 2

    def get_model_parallel_world_size(self):
        return 1


def _param(values, expert=False):
    p = torch.nn.Parameter(torch.zeros(len(values)))
    p.grad = torch.tensor(values)
    if expert:  # upstream's marks of an expert parameter
        p.allreduce = False
        p.group_name = "ep_size_2"
    return p


def verdicts():
    import deepspeed.runtime.utils as ds_utils
    from deepspeed.utils import groups
    from torch._utils import _flatten_dense_tensors
    rank = torch.distributed.get_rank()
    groups._create_expert_and_data_parallel(2)
    mpu = _Mpu()
    out = {}
    try:
        for name, (dense, expert) in CASES.items():
            params = [_param(dense[rank]), _param(expert[rank], expert=True)]
            norm = ds_utils.get_weight_norm([_flatten_dense_tensors([p.grad for p in params])])  # -1 if not finite
            for how, checker in (("plain", ds_utils.CheckOverflow([params])), ("mpu",
                                                                               ds_utils.CheckOverflow([params],
                                                                                                      mpu=mpu))):
                out[(name, how, "check")] = checker.check()
                out[(name, how, "check_groups")] = ds_utils.CheckOverflow().check(param_groups=[params])
                out[(name, how, "has_overflow")] = checker.has_overflow(params)
                out[(name, how, "norm")] = checker.check_using_norm([norm], reduce_overflow=False)
            out[(name, "serial")] = ds_utils.CheckOverflow([params]).has_overflow_serial(params)
            out[(name, "has_moe_params")] = ds_utils.CheckOverflow([params]).has_moe_params
    finally:
        groups.reset_mesh()
    return out


def test_check_overflow_agrees_over_the_ranks():
    results = run_distributed(verdicts, 2)
    for name, (dense, expert) in CASES.items():
        grads = [torch.tensor(dense[r] + expert[r]) for r in range(2)]
        anywhere = any(not bool(torch.isfinite(g).all()) for g in grads)  # plain torch, every rank's gradients
        for rank, out in enumerate(results):
            assert out[(name, "serial")] == (not bool(torch.isfinite(grads[rank]).all())), (name, rank)
            assert out[(name, "has_moe_params")] is True
            for how in ("plain", "mpu"):
                for entry in ("check", "check_groups", "has_overflow", "norm"):
                    assert out[(name, how, entry)] is anywhere, (name, how, entry, rank)


def expert_overflow_on_one_rank():
    import deepspeed
    from deepspeed.runtime.utils import CheckOverflow
    from deepspeed.utils import groups
    from tests.unit.moe.test_moe_contract import D, S, Net
    rank = torch.distributed.get_rank()
    model = Net(ep=2, k=1)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 1.0,
        "bf16": {
            "enabled": True
        },
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": 40
        },
    }
    engine = deepspeed.initialize(model=model, config=config)[0]
    experts = model.moe.deepspeed_moe.experts.deepspeed_experts
    if rank == 1:
        experts[0].fc1.weight.register_hook(lambda g: g * INF)
    x = torch.randn(S, D, generator=torch.Generator().manual_seed(5 + rank)).to(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    probe = []
    for p in experts[0].parameters():  # what the utility says of the same kind of fault, before the engine's step
        q = torch.nn.Parameter(torch.zeros(1))
        q.grad = torch.full((1, ), INF if rank == 1 else 1.0)
        q.allreduce, q.group_name = False, p.group_name
        probe.append(q)
    utility = CheckOverflow([probe]).check()
    engine.backward(engine(x))
    engine.step()
    unchanged = all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
    out = dict(applied=engine.was_step_applied(), skipped=engine.skipped_steps, unchanged=unchanged, utility=utility)
    engine.destroy()
    groups.reset_mesh()
    return out


def test_engine_skips_an_expert_overflow_on_every_rank():
    for out in run_distributed(expert_overflow_on_one_rank, 2):
        assert out == dict(applied=False, skipped=1, unchanged=True, utility=True), out
