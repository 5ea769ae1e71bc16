# SPDX-License-Identifier: Apache-2.0
"""ZeRO++ with experts of expert-parallel size 2 on ZeRO-3 (world 4: expert-data-parallel groups of 2 ranks).

The MoE layer of ``test_moe_contract`` (``deepspeed.moe.layer.MoE``, ep 2; the experts' ``fc2`` frozen) trains 2
Adam steps, against an exact ZeRO-3 run whose frozen values were round-tripped through the quantizer beforehand:

* qwZ and qgZ with hpZ's nodes of 2 ranks. Every all-gather of an expert unit, over its expert-data-parallel
  group, gives bitwise what the quantization written here in plain torch (symmetric 8-bit blocks of 4096 from the
  row's start, ``scale = max |x| / 127``, ``q = round(x / scale)``, ``x' = q * scale``) gives of that group's rows
  (each member's row taken from the gather's own send); every reduce-scatter of an expert unit gives bitwise the
  plain-torch 4-bit maths over the group's inputs (each sender's row for this rank quantized in blocks of 512,
  dequantized, summed over the senders in rank order in float32). An expert-data-parallel group ([0, 2],
  [1, 3]) has one member per node, so the expert units have no node axis (the dense units have theirs). The losses
  stay within 5% of the exact run's, per step;
* hpZ with one node of 4 ranks: the expert-data-parallel group is its own sub-node, the expert units keep a
  secondary shard and their backward gathers run on the sub-node's group (recorded); losses and fp32 masters
  bitwise those of the exact run;
* quantized frozen experts (``zero_quantized_nontrainable_weights``): the gathered frozen values are bitwise the
  plain-torch round trip of each shard of the expert-data-parallel group; the losses equal (1e-6) the exact run's;
* AutoEP (Mixtral's tiny model, ``autoep_size`` 2) with qwZ and qgZ: expert gathers and reduce-scatters bitwise the
  plain-torch maths as above; losses within 5% of plain torch's (Adam on the rank-mean gradient), per step.

The sub-node tables (the expert-data-parallel groups cut by the node axis) are checked alone, on larger worlds.
"""

import pytest
import torch

from tests.unit.common import run_distributed

T = 300
STEPS, LR = 2, 0.02
# Quantized runs against the exact one, per step: two Adam steps normalise the quantization noise of small
# gradients, so the bound is looser than the 2% of the 50-step mean the dense ZeRO++ test uses.
QUANT_REL = 0.05


# --------------------------------------------------------------------------- plain-torch quantization maths
def _round_trip(rows, bits, block):
    """Symmetric block quantization and back, per row (blocks from each row's start), in float32."""
    rows = rows.float()
    n, numel = rows.shape
    blocks = max(1, -(-numel // block))
    padded = torch.zeros(n, blocks * block)
    padded[:, :numel] = rows
    padded = padded.view(n, blocks, block)
    top = (1 << (bits - 1)) - 1
    scale = padded.abs().amax(dim=2, keepdim=True) / top
    codes = torch.where(scale > 0, torch.round(padded / torch.where(scale > 0, scale, torch.ones_like(scale))),
                        torch.zeros_like(padded)).clamp(-top, top)
    return (codes * scale).view(n, blocks * block)[:, :numel]


def _group_all_gather(tensor, group, size):
    out = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(out, tensor.contiguous(), group=group)
    return out


# ------------------------------------------------------------------------------------------- recorders
def _record_gathers(plan, records):
    """Record ``(sent row, gathered values)`` of every all-gather of ``plan`` (a UnitFetchPlan)."""
    launch, finish, sent = plan.launch, plan.finish, {}

    def recording_launch(send, backward, unit_index, keep=True):
        sent[unit_index] = None if send is None else send.detach().clone()
        return launch(send, backward, unit_index, keep)

    def recording_finish(buffer, numel, dtype, keep, unit_index):
        out = finish(buffer, numel, dtype, keep, unit_index)
        records.append((sent.pop(unit_index), out.detach().clone()))
        return out

    plan.launch, plan.finish = recording_launch, recording_finish


def _record_reductions(transport, records):
    inner = transport.reduce_scatter

    def recording(output, input, group):
        work = inner(output, input, group)
        assert work is None  # qgZ's reduce-scatter completes in the call
        records.append((input.detach().clone(), output.detach().clone()))
        return work

    transport.reduce_scatter = recording


def _check_gathers(records, spec):
    """Mismatches of recorded expert gathers against the plain-torch 8-bit maths of the group's sent rows."""
    from deepspeed.runtime.zero.gradients import block_quant as bq
    bad = []
    for i, (send, got) in enumerate(records):
        rows = torch.stack(_group_all_gather(send, spec.group, spec.world_size))
        want = _round_trip(rows, bq.WEIGHT_BITS, bq.WEIGHT_BLOCK).to(got.dtype)
        if not torch.equal(got.view(want.shape), want):
            bad.append(f"expert gather {i}: |diff| {float((got.view(want.shape) - want).abs().max())}")
    return bad


def _check_reductions(records, spec):
    from deepspeed.runtime.zero.gradients import block_quant as bq
    bad = []
    for i, (inp, got) in enumerate(records):
        inputs = _group_all_gather(inp, spec.group, spec.world_size)
        rows = [x.view(spec.world_size, -1)[spec.rank:spec.rank + 1] for x in inputs]
        want = torch.stack([_round_trip(r, bq.GRAD_BITS, bq.GRAD_BLOCK)[0] for r in rows]).sum(dim=0)
        if not torch.equal(got.float(), want):
            bad.append(f"expert reduce-scatter {i}: |diff| {float((got.float() - want).abs().max())}")
    return bad


# ---------------------------------------------------------------------------------------------- MoE layer
def _config(zero):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": dict({
            "stage": 3,
            "reduce_bucket_size": 40,
            "stage3_param_persistence_threshold": 0
        }, **zero),
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": LR,
                "weight_decay": 0.0
            }
        }
    }


def _freeze_fc2(model, round_trip_over=None):
    """Freeze every local expert's ``fc2``; with ``round_trip_over`` (the group size), give each the values a
    gather of its quantized shards gives (plain torch: each padded shard quantized on its own)."""
    from deepspeed.runtime.zero.units.frozen_quant import BLOCK, BITS
    for expert in model.moe.deepspeed_moe.experts.deepspeed_experts:
        for p in expert.fc2.parameters():
            p.requires_grad_(False)
            if round_trip_over:
                shard = -(-p.numel() // round_trip_over)
                flat = torch.zeros(round_trip_over * shard)
                flat[:p.numel()] = p.detach().reshape(-1)
                back = torch.cat([
                    _round_trip(flat[r * shard:(r + 1) * shard].view(1, -1), BITS, BLOCK)[0]
                    for r in range(round_trip_over)
                ])
                with torch.no_grad():
                    p.copy_(back[:p.numel()].view(p.shape))


def _train(zero, check=None, frozen=None):
    """``(losses, {name: fp32 master or full value}, mismatches)`` after STEPS steps of the MoE layer at ep 2."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from tests.unit.moe.test_moe_contract import D, S, Net
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = Net(2, 1)
    if frozen is not None:
        _freeze_fc2(model, round_trip_over=world // 2 if frozen == "round_trip" else None)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=_config(zero))
    stage = engine._stage
    (name, plan), = stage.coordinator._expert_fetch.items()
    spec = next(s for s in stage._expert_specs.values() if s.name == name)
    assert spec.world_size == world // 2
    gathers, reductions, bad = [], [], []
    check_of = check or ""
    if "qwZ" in check_of:
        assert plan.wire.quantized and not plan.hierarchical
        _record_gathers(plan, gathers)
    if "qgZ" in check_of:
        _record_reductions(stage.geometry.transport.of(spec.group), reductions)
    node_gathers = []
    if "hpZ" in check_of and check != "hpZ whole":  # nodes of 2: the dense units hierarchical, the experts (sub-nodes
        # of one rank) gather over their group in the backward too
        assert stage.coordinator.fetch.hierarchical and not plan.hierarchical
    if check == "hpZ whole":  # one node: the group is its own sub-node; its backward gathers run over it
        group_ranks = tuple(torch.distributed.get_process_group_ranks(spec.group))
        assert plan.hierarchical and plan.node_axis.node_ranks == group_ranks and plan.node_axis.nodes == 1
        inner = plan.node_transport.all_gather

        def recording(output, input, group):
            node_gathers.append(tuple(torch.distributed.get_process_group_ranks(group)))
            return inner(output, input, group)

        plan.node_transport.all_gather = recording
    if frozen == "quantized":
        from deepspeed.runtime.zero.units.frozen_quant import is_quantized
        frozen_params = [p for p in model.parameters() if not p.requires_grad]
        assert frozen_params and all(is_quantized(p) for p in frozen_params)
        with deepspeed.zero.GatheredParameters(frozen_params):
            got = [p.detach().clone() for p in frozen_params]
        reference = Net(2, 1)
        _freeze_fc2(reference, round_trip_over=spec.world_size)
        want = [p.detach() for p in reference.parameters() if not p.requires_grad]
        bad += [
            f"frozen expert {i} not the round trip" for i, (a, b) in enumerate(zip(got, want))
            if not torch.equal(a, b)
        ]
    g = torch.Generator().manual_seed(11)
    data = [[torch.randn(S, D, generator=g) for _ in range(world)] for _ in range(STEPS)]
    losses = []
    for xs in data:
        loss = engine(xs[rank])
        losses.append(float(loss))
        engine.backward(loss)
        engine.step()
    if check == "hpZ whole":
        assert node_gathers and all(g == group_ranks for g in node_gathers), node_gathers
        assert plan.secondary_numel() == 0  # dropped at the step
    if "qwZ" in check_of:
        assert gathers
        bad += _check_gathers(gathers, spec)
    if "qgZ" in check_of:
        assert reductions
        bad += _check_reductions(reductions, spec)
    masters = {n: safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters() if p.requires_grad}
    engine.destroy()
    return losses, masters, bad


def _close(what, losses, exact, rel):
    return [f"{what} loss {i}: {a} vs {b}" for i, (a, b) in enumerate(zip(losses, exact)) if abs(a - b) > rel * abs(b)]


def _moe_cells():
    from deepspeed.utils import groups
    # the reference: the experts' fc2 frozen at the values a gather of their quantized shards gives
    exact_losses, exact_masters, _ = _train({}, frozen="round_trip")
    losses, masters, bad = _train({"zero_hpz_partition_size": 4}, check="hpZ whole", frozen="round_trip")
    bad += [f"hpZ 4 loss {i}" for i, (a, b) in enumerate(zip(losses, exact_losses)) if a != b]
    bad += [f"hpZ 4 {n} not bitwise" for n in masters if not torch.equal(masters[n], exact_masters[n])]
    losses, _, mismatches = _train({"zero_quantized_nontrainable_weights": True}, frozen="quantized")
    bad += mismatches + _close("frozen", losses, exact_losses, 1e-6)
    # hpZ's nodes of 2 as well: the dense units go hierarchical, the expert units (sub-nodes of one rank) do not
    losses, _, mismatches = _train(
        {
            "zero_quantized_weights": True,
            "zero_quantized_gradients": True,
            "zero_hpz_partition_size": 2
        },
        check="qwZ+qgZ+hpZ",
        frozen="round_trip")
    bad += mismatches + _close("qwZ+qgZ", losses, exact_losses, QUANT_REL)
    bad += ["qwZ+qgZ: not quantized" for _ in [0] if losses == exact_losses]
    groups.reset_mesh()
    return bad


def test_moe_layer_zeropp_experts():
    assert run_distributed(_moe_cells, 4, timeout=T) == [[]] * 4


# ------------------------------------------------------------------------------------------------- AutoEP
def _autoep_data(world):
    from tests.unit.moe.autoep_models import VOCAB
    g = torch.Generator().manual_seed(5)
    return [[torch.randint(0, VOCAB, (1, 6), generator=g) for _ in range(world)] for _ in range(STEPS)]


def _autoep(zero):
    import deepspeed
    from tests.unit.moe.autoep_models import mixtral
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = mixtral()
    config = _config(zero)
    config["zero_optimization"]["reduce_bucket_size"] = 700
    config["expert_parallel"] = {"enabled": True, "autoep_size": 2}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    stage = engine._stage
    (name, plan), = stage.coordinator._expert_fetch.items()
    spec = next(s for s in stage._expert_specs.values() if s.name == name)
    gathers, reductions = [], []
    if zero:
        _record_gathers(plan, gathers)
        _record_reductions(stage.geometry.transport.of(spec.group), reductions)
    losses = []
    for batch in _autoep_data(world):
        ids = batch[rank]
        loss = engine(input_ids=ids, labels=ids).loss
        losses.append(float(loss))
        engine.backward(loss)
        engine.step()
    bad = []
    if zero:
        assert gathers and reductions
        bad = _check_gathers(gathers, spec) + _check_reductions(reductions, spec)
    engine.destroy()
    return losses, bad


def _autoep_reference():
    """Plain torch: the same model and Adam on the gradient averaged over the ranks; this rank's losses."""
    from tests.unit.moe.autoep_models import mixtral
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = mixtral()
    opt = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for batch in _autoep_data(world):
        opt.zero_grad()
        for r, ids in enumerate(batch):
            loss = model(input_ids=ids, labels=ids).loss
            if r == rank:
                losses.append(float(loss))
            (loss / world).backward()
        opt.step()
    return losses


def _autoep_cells():
    from deepspeed.utils import groups
    losses, bad = _autoep({"zero_quantized_weights": True, "zero_quantized_gradients": True})
    groups.reset_mesh()
    reference = _autoep_reference()
    return bad + _close("AutoEP", losses, reference,
                        QUANT_REL) + (["AutoEP: not quantized"] if losses == reference else [])


def test_autoep_qwz_qgz_experts():
    pytest.importorskip("transformers")
    assert run_distributed(_autoep_cells, 4, timeout=T) == [[]] * 4


# ------------------------------------------------------------------------------------------ sub-node tables
def test_expert_node_size():
    from deepspeed.utils.node_axis import expert_node_size, node_tables

    def edp(world, ep):
        return tuple(tuple(range(j, world, ep)) for j in range(ep))

    def nodes(world, h):
        return node_tables((tuple(range(world)), ), h)[0]

    assert expert_node_size(edp(4, 2), nodes(4, 2)) == 1  # one member of each group a node
    assert expert_node_size(edp(4, 2), nodes(4, 4)) == 2  # the whole group in one node
    assert expert_node_size(edp(8, 2), nodes(8, 4)) == 2  # [0, 2] | [4, 6]
    assert expert_node_size(edp(16, 2), nodes(16, 8)) == 4
    assert expert_node_size(edp(8, 4), nodes(8, 2)) == 1
    assert expert_node_size(edp(12, 4), nodes(12, 6)) is None  # [0, 4] | [8]: sub-nodes of unequal sizes
    assert expert_node_size(((0, 2, 1, 3), ), nodes(4, 2)) is None  # a node's members not consecutive
    # the sub-nodes of the expert groups are the node tables of the expert groups
    assert node_tables(edp(8, 2), 2)[0] == ((0, 2), (4, 6), (1, 3), (5, 7))


def test_expert_node_size_random_meshes():
    """Seeded random worlds, expert-parallel sizes and node sizes against the definition by sets: the sub-nodes
    are the non-empty intersections of an expert group with the nodes; regular when they all have one size and
    each is a run of consecutive members of its group."""
    from deepspeed.utils.node_axis import expert_node_size, node_tables
    gen = torch.Generator().manual_seed(17)
    seen = set()
    for _ in range(60):
        world = int(torch.randint(2, 25, (), generator=gen))
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        ep = divisors[int(torch.randint(len(divisors), (), generator=gen))]
        h = divisors[int(torch.randint(len(divisors), (), generator=gen))]
        groups = [list(range(j, world, ep)) for j in range(ep)]
        nodes = [set(range(i, i + h)) for i in range(0, world, h)]
        sizes, runs = set(), True
        for group in groups:
            for node in nodes:
                members = [r for r in group if r in node]
                if members:
                    sizes.add(len(members))
                    first = group.index(members[0])
                    runs = runs and group[first:first + len(members)] == members
        want = sizes.pop() if len(sizes) == 1 and runs else None
        got = expert_node_size(tuple(map(tuple, groups)), node_tables((tuple(range(world)), ), h)[0])
        assert got == want, (world, ep, h, got, want)
        seen.add(want is None)
    assert seen == {True, False}  # both regular and irregular meshes were drawn
