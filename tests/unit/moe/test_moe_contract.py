# SPDX-License-Identifier: Apache-2.0
"""The gradient contract with expert parallelism: every dense and expert parameter's optimizer-visible gradient
equals a plain-torch reference that runs every expert on one rank with the same routing.

Worlds 2 and 4, ep 1 and 2, ZeRO 0, 1, 2, fp32 and bf16, GAS 1 and 4, top-1 and top-2, optimizers from
the config and client optimizers with experts in param groups of their own or mixed with dense
parameters. Each rank's loss is its mean over its tokens plus the aux loss; the reference is
``1/(W GAS) sum over ranks and micro-steps of d loss / dp``, computed by every rank for every
rank's data with a model holding all ``E`` experts (tests/unit/moe/reference.py); bf16 cells
compare with the same model at ep 1 in plain torch and bf16, so that both sides round alike.
One micro-step sends every token to the experts of expert-parallel rank 0, so the other rank's
experts receive no token in it. ZeRO 3 holds experts of expert-parallel size 1 (sharded like dense
parameters) and of size 2 (sharded over their expert-data-parallel group), with the optimizer offloaded too
(test_stage3_expert_offload.py trains them, also with parameter offload; test_stage3_expert_zeropp.py with ZeRO++;
tests/unit/zenflow/test_zenflow_experts.py with ZenFlow).
"""

import itertools

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.moe.reference import reference_moe_output

D, H, E, S = 6, 5, 4, 9
AUX = 0.05
T = 240


class _Expert(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(D, H)
        self.fc2 = torch.nn.Linear(H, D)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _expert_values(e):
    g = torch.Generator().manual_seed(1000 + e)
    return [
        torch.randn(H, D, generator=g) * 0.5,
        torch.randn(H, generator=g) * 0.1,
        torch.randn(D, H, generator=g) * 0.5,
        torch.randn(D, generator=g) * 0.1
    ]


def _dense_values():
    g = torch.Generator().manual_seed(7)
    gate = torch.randn(E, D, generator=g)
    gate[:, 0] = torch.tensor([1.0, 1.0, -1.0, -1.0])  # feature 0 steers tokens to experts 0, 1 (ep rank 0)
    return dict(inp=(torch.eye(D) + 0.1 * torch.randn(D, D, generator=g), 0.1 * torch.randn(D, generator=g)),
                gate=gate,
                out=(torch.randn(1, D, generator=g), torch.randn(1, generator=g)))


def _local_experts(rank, ep):
    per = E // ep
    return list(range((rank % ep) * per, (rank % ep) * per + per))


class Net(torch.nn.Module):

    def __init__(self, ep, k):
        from deepspeed.moe.layer import MoE
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters
        super().__init__()
        self.inp = torch.nn.Linear(D, D)
        self.moe = MoE(D,
                       _Expert(),
                       num_experts=E,
                       ep_size=ep,
                       k=k,
                       capacity_factor=1.0,
                       min_capacity=1,
                       use_rts=False,
                       top2_2nd_expert_sampling=False)
        self.out = torch.nn.Linear(D, 1)
        values = _dense_values()
        dense = [self.inp.weight, self.inp.bias, self.moe.deepspeed_moe.gate.wg.weight, self.out.weight, self.out.bias]
        with torch.no_grad(), GatheredParameters(dense, modifier_rank=0):  # (built under zero.Init: partitioned)
            self.inp.weight.copy_(values["inp"][0])
            self.inp.bias.copy_(values["inp"][1])
            self.moe.deepspeed_moe.gate.wg.weight.copy_(values["gate"])
            self.out.weight.copy_(values["out"][0])
            self.out.bias.copy_(values["out"][1])
        with torch.no_grad():
            # distinct experts, by global index: ep rank r (rank % ep in the standard layout) holds r*L .. r*L+L-1
            rank = torch.distributed.get_rank()
            for local, e in enumerate(_local_experts(rank, ep)):
                expert = self.moe.deepspeed_moe.experts.deepspeed_experts[local]
                for p, v in zip(expert.parameters(), _expert_values(e)):
                    p.copy_(v)

    def forward(self, x):
        h = self.inp(x)
        m, l_aux, _ = self.moe(h)
        return (self.out(h + m).float().square()).mean() + AUX * l_aux


def _data(world, gas):
    """``[micro][rank]`` inputs; micro-step 1 (when there is one) steers every token to ep rank 0's experts."""
    g = torch.Generator().manual_seed(99)
    data = [[torch.randn(S, D, generator=g) for _ in range(world)] for _ in range(gas)]
    if gas > 1:
        for x in data[1]:
            x[:, 0] = 25.0
    return data


def reference_layers(source=lambda e: e):
    """``Net``'s layers in plain torch with every expert on this rank: ``(inp, out, gate, experts)``, expert ``e``
    starting from ``_expert_values(source(e))``."""
    values = _dense_values()
    inp = torch.nn.Linear(D, D)
    out = torch.nn.Linear(D, 1)
    gate = torch.nn.Parameter(values["gate"].clone())
    experts = [_Expert() for _ in range(E)]
    with torch.no_grad():
        inp.weight.copy_(values["inp"][0])
        inp.bias.copy_(values["inp"][1])
        out.weight.copy_(values["out"][0])
        out.bias.copy_(values["out"][1])
        for e, expert in enumerate(experts):
            for p, v in zip(expert.parameters(), _expert_values(source(e))):
                p.copy_(v)
    return inp, out, gate, experts


def _reference(world, gas, k, dtype):
    """Reference gradients: ``{'inp.weight': ..., 'expert3.fc1.weight': ...}`` (float32), token by token."""
    inp, out, gate, experts = reference_layers()
    modules = [inp, out] + experts
    for m in modules:
        m.to(dtype).float()
    gate.data = gate.data.to(dtype).float()
    named = dict(
        itertools.chain([("inp." + n, p) for n, p in inp.named_parameters()],
                        [("out." + n, p) for n, p in out.named_parameters()], [("gate", gate)],
                        [(f"expert{e}." + n, p) for e, ex in enumerate(experts) for n, p in ex.named_parameters()]))
    grads = {n: torch.zeros(p.shape) for n, p in named.items()}
    empty_seen = False
    for micro, xs in enumerate(_data(world, gas)):
        for x in xs:
            x = x.to(dtype).float()
            h = inp(x)
            m, l_aux, routes = reference_moe_output(h, gate, experts, k, 1.0, 1)
            loss = (out(h + m).float().square()).mean() + AUX * l_aux
            if micro == 1:
                empty_seen = empty_seen or all(e < E // 2 for r in routes for e, _, _ in r)
                assert all(e < E // 2 for r in routes for e, _, _ in r), "micro-step 1 must avoid experts 2, 3"
            got = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
            for n, g in zip(named, got):
                if g is not None:
                    grads[n] += g.float() / (world * gas)
    return grads, (empty_seen or gas == 1)


def _reference_bf16(world, gas, k):
    """bf16 cells: the same model with every expert on this rank (ep 1) in plain torch and bf16, so that both
    sides round alike; the float32 cells check the layer's maths against the token-by-token reference."""
    model = Net(1, k).to(torch.bfloat16)
    named = dict([("inp." + n, p) for n, p in model.inp.named_parameters()] +
                 [("out." + n, p)
                  for n, p in model.out.named_parameters()] + [("gate", model.moe.deepspeed_moe.gate.wg.weight)] +
                 [(f"expert{e}." + n, p) for e, ex in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts)
                  for n, p in ex.named_parameters()])
    grads = {n: torch.zeros(p.shape) for n, p in named.items()}
    for xs in _data(world, gas):
        for x in xs:
            got = torch.autograd.grad(model(x.to(torch.bfloat16)), list(named.values()), allow_unused=True)
            for n, g in zip(named, got):
                if g is not None:
                    grads[n] += g.float() / (world * gas)
    return grads, True


def _engine_grads(engine, model, ep):
    from deepspeed.utils import safe_get_full_grad
    out = {}
    for n, p in model.inp.named_parameters():
        out["inp." + n] = safe_get_full_grad(p)
    for n, p in model.out.named_parameters():
        out["out." + n] = safe_get_full_grad(p)
    out["gate"] = safe_get_full_grad(model.moe.deepspeed_moe.gate.wg.weight)
    for local, e in enumerate(model.moe.global_expert_indices):
        expert = model.moe.deepspeed_moe.experts.deepspeed_experts[local]
        for n, p in expert.named_parameters():
            out[f"expert{e}." + n] = safe_get_full_grad(p)
    return out


def _run_cell(stage, dtype_name, gas, ep, k, client_optimizer, offload=False):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    model = Net(ep, k)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 40
        }
    }
    if dtype_name == "bf16":
        config["bf16"] = {"enabled": True}
    optimizer = None
    if client_optimizer == "split":  # experts in param groups of their own, as upstream asks
        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters())})
        optimizer = torch.optim.SGD(groups, lr=0.0)
    elif client_optimizer == "mixed":  # one param group holding dense and expert parameters
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    elif offload:  # the pipelined host step (host Adam; lr 0 leaves the weights as they are)
        config["optimizer"] = {"type": "Adam", "params": {"lr": 0.0}}
    else:
        config["optimizer"] = {"type": "SGD", "params": {"lr": 0.0}}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "super_offload": offload == "super"}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if offload:
        stage_impl = engine._stage
        # bf16 masters' uploads run in the pipelined host step (fp32 models step on torch's kernels by default)
        assert stage_impl.host_step is not None and (dtype_name == "fp32" or stage_impl._pipelined())
    assert model.moe.global_expert_indices == _local_experts(rank, ep)
    if stage == 3:  # experts sharded over their expert-data-parallel group (world / ep ranks), the rest over all
        for name, p in model.named_parameters():
            over = world // ep if ".deepspeed_experts." in name else world
            assert p.ds_shard_numel == -(-p.ds_numel // over), (name, p.ds_shard_numel, over)
    data = _data(world, gas)
    got = None
    for micro in range(gas):
        loss = engine(data[micro][rank].to(dtype))
        engine.backward(loss)
        if micro == gas - 1:
            got = _engine_grads(engine, model, ep)
        engine.step()
    norm = float(engine.get_global_grad_norm())  # of the whole gradient: every rank's experts counted once
    held = []
    if stage == 3:  # GatheredParameters gathers an expert over its group: this rank's experts' values (lr 0)
        engine.empty_partition_cache()  # persistent units too: the gathers below are GatheredParameters' own
        for local, e in enumerate(_local_experts(rank, ep)):
            expert = model.moe.deepspeed_moe.experts.deepspeed_experts[local]
            with deepspeed.zero.GatheredParameters(list(expert.parameters())):
                held += [(e, p.detach().float().clone(), v.to(dtype).float())
                         for p, v in zip(expert.parameters(), _expert_values(e))]
    engine.destroy()
    want, empty_seen = _reference(world, gas, k, dtype) if dtype_name == "fp32" else _reference_bf16(world, gas, k)
    tol = 1e-5 if dtype_name == "fp32" else 2e-2
    bad = []
    # Rounding noise scales with the activations, not with one parameter's gradient (a lightly used expert's
    # or a bias summed over ranks with cancellation is small), so the yardstick is at least 5% of the whole
    # gradient's norm.
    floor = 0.05 * float(torch.cat([w.reshape(-1) for w in want.values()]).norm())
    for n, g in got.items():
        w = want[n]
        err = float((g.float() - w).norm())
        scale = max(float(w.norm()), floor)
        if not err <= tol * scale:
            bad.append(f"{n}: |diff| {err:.3g} vs |ref| {scale:.3g}")
    ref_norm = float(torch.cat([w.reshape(-1) for w in want.values()]).norm())
    if not abs(norm - ref_norm) <= (1e-5 if dtype_name == "fp32" else 2e-2) * ref_norm:
        bad.append(f"global grad norm {norm} vs {ref_norm}")
    bad += [f"gathered expert {e}" for e, got_value, value in held if not torch.equal(got_value, value)]
    assert empty_seen
    return bad


def _run_cells(cells):
    failures = []
    for cell in cells:
        bad = _run_cell(*cell)
        if bad:
            failures.append((cell, bad[:4]))
    from deepspeed.utils import groups
    groups.reset_mesh()
    return failures


def _cells(world):
    cells = []
    for stage, dtype, gas, ep in itertools.product([0, 1, 2], ["fp32", "bf16"], [1, 4], [1, 2]):
        k = 1 + (stage + gas + ep) % 2  # top-1 and top-2 both on every stage
        cells.append((stage, dtype, gas, ep, k, ["split", "mixed", None][(stage + gas + ep) % 3]))
    return cells


@pytest.mark.parametrize("world", [2, 4])
def test_moe_contract(world):
    # ZeRO-3 holds experts of expert-parallel size 1 (every rank holds every expert) sharded like dense parameters,
    # and experts of size 2 sharded over their expert-data-parallel group (one rank at world 2, two at world 4)
    stage3 = [(3, "fp32", 4, 1, 2, None), (3, "bf16", 1, 1, 1, "split"), (3, "fp32", 4, 2, 2, None),
              (3, "bf16", 1, 2, 1, "split")] if world == 2 else [(3, "fp32", 1, 1, 1, None),
                                                                 (3, "fp32", 4, 2, 2, "mixed"),
                                                                 (3, "bf16", 1, 2, 1, None)]
    failures = run_distributed(_run_cells, world, args=(_cells(world) + stage3, ), timeout=T)
    assert failures == [[]] * world, failures[0]


def test_moe_contract_offload():
    """Experts with offload_optimizer (the pipelined host step) on ZeRO 1 and 2: ep 1 and 2, fp32 and bf16, and with
    super_offload (the step started in the boundary backward)."""
    cells = [(1, "fp32", 4, 2, 2, None, True), (2, "bf16", 1, 2, 1, None, True), (2, "fp32", 4, 1, 1, None, True),
             (1, "bf16", 4, 2, 1, None, "super")]
    assert run_distributed(_run_cells, 2, args=(cells, ), timeout=T) == [[], []]
