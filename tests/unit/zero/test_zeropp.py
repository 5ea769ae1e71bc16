# SPDX-License-Identifier: Apache-2.0
"""ZeRO++ on ZeRO-3: hpZ (secondary shards in node groups), qwZ and qgZ (quantized transports), and refusals.

* block quantization: every element's round-trip error is at most half a step of its own block
  (``max |x| over the block / qmax / 2``), on seeded random shapes (1 element, sizes that are not a
  multiple of the block), 4 and 8 bits; all-zero blocks come back exactly;
* the node axis's rank tables (pure);
* hpZ at world 4 with nodes of 2 ranks: losses, full gradients and parameters over 3 steps bitwise those
  of plain ZeRO-3 on the same model (also with parameter and optimizer offload and 2 micro-steps a
  step); the backward all-gathers run on the node group (a recording wrapper checks each one's ranks)
  and the comms logger records them under their own name, each sending the rank's N = W / h rows; as
  many gathers in all as plain ZeRO-3's; world 2 with nodes of 2 (the node group is the world) and
  ``h = 1`` (off: no node gather at all);
* qgZ's reduce-scatter alone at world 4, one hop and two (nodes of 2): every element within the sum of
  the half-steps of the blocks it went through, against the exact sum;
* qwZ and qgZ at world 4 (qgZ's two hops over nodes of 2, with hpZ) and world 2 (one hop): the bytes of
  every all-gather / reduce-scatter as the wire format says (counted by the comms logger), and the mean loss
  of 50 steps (25 at world 2) within 2% of the exact run's, the last within 5% of the first loss plus 5% of
  the exact last, on a small regression model;
* configurations that cannot be honoured raise at ``initialize`` naming the keys.
"""

import pytest
import torch

from tests.unit.common import run_distributed


# ----------------------------------------------------------------------------------------- block quantization
def _block_bound(x, bits, block):
    from deepspeed.runtime.zero.gradients import block_quant as bq
    rows, numel = x.shape
    blocks = bq.num_blocks(numel, block)
    padded = torch.nn.functional.pad(x.float(), (0, blocks * block - numel)).view(rows, blocks, block)
    step = padded.abs().amax(dim=2) / bq.qmax(bits)
    return (step / 2).repeat_interleave(block, dim=1)[:, :numel]


@pytest.mark.parametrize("bits", [4, 8])
def test_block_quant_round_trip(bits):
    from deepspeed.runtime.zero.gradients import block_quant as bq
    gen = torch.Generator().manual_seed(7 + bits)
    shapes = [(1, 1, 2), (1, 1, 512), (3, 7, 4), (2, 4097, 4096), (1, 513, 512)]
    for _ in range(4):
        shapes.append((int(torch.randint(1, 5, (), generator=gen)), int(torch.randint(1, 3000, (), generator=gen)),
                       int(2 * torch.randint(1, 300, (), generator=gen))))
    for rows, numel, block in shapes:
        scale = torch.rand(rows, 1, generator=gen) * 100
        x = torch.randn(rows, numel, generator=gen) * scale
        x[:, :min(numel, block)] *= (torch.rand(rows, min(numel, block), generator=gen) > 0.5)
        packed = bq.quantize_rows(x, bits, block)
        assert packed.dtype == torch.uint8 and packed.shape == (rows, bq.row_bytes(numel, bits, block))
        back = bq.dequantize_rows(packed, numel, bits, block, torch.empty_like(x))
        err = (back - x).abs()
        bound = _block_bound(x, bits, block)
        assert bool((err <= bound * (1 + 1e-6)).all()), (rows, numel, block, float((err - bound).max()))
        # each row is packed on its own: a row alone packs to the same bytes
        assert torch.equal(bq.quantize_rows(x[-1:], bits, block), packed[-1:])
    zeros = torch.zeros(2, 9)
    assert torch.equal(bq.dequantize_rows(bq.quantize_rows(zeros, bits, 4), 9, bits, 4, torch.ones(2, 9)), zeros)
    # bf16 in and out: the block error plus the final bf16 rounding
    x = torch.randn(3, 1000, generator=gen).bfloat16()
    back = bq.dequantize_rows(bq.quantize_rows(x, bits, 256), 1000, bits, 256, torch.empty_like(x))
    bound = _block_bound(x, bits, 256) + x.float().abs() * 2**-8 + _block_bound(x, bits, 256) * 2**-7
    assert bool(((back.float() - x.float()).abs() <= bound).all())


def _qgz_case(h, numel):
    """QuantizedReduceScatter against the exact sum: every element within its bound (module docstring)."""
    from deepspeed.runtime.zero.gradients import block_quant as bq
    from deepspeed.runtime.zero.gradients.quantized_reduce import QuantizedReduceScatter
    from deepspeed.utils.node_axis import build_node_axis
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    inputs = [
        torch.randn(world, numel, generator=torch.Generator().manual_seed(50 + r)) * (1 + r) for r in range(world)
    ]
    axis = build_node_axis(h, cross=True) if 1 < h < world else None
    out = torch.empty(numel)
    assert QuantizedReduceScatter(world, axis).reduce_scatter(out, inputs[rank].reshape(-1), None) is None
    exact = sum(x[rank] for x in inputs)

    def half_step(rows):  # per element: half a 4-bit step of its block, rows (k, numel)
        return _block_bound(rows, 4, bq.GRAD_BLOCK)

    if axis is None:
        bound = sum(half_step(x[rank:rank + 1])[0] for x in inputs)
    else:
        nodes = world // h
        bound = torch.zeros(numel)
        for n in range(nodes):
            members = range(n * h, (n + 1) * h)
            partial = sum(inputs[s][rank] for s in members)
            first = sum(half_step(inputs[s][rank:rank + 1])[0] for s in members)
            # the second hop quantizes the dequantized partial sum: its block maximum is at most the exact one
            # plus the first hop's error
            top = _block_bound((partial.abs() + first).view(1, -1), 4, bq.GRAD_BLOCK)[0]
            bound += first + top
    err = (out - exact).abs()
    assert bool((err <= bound * (1 + 1e-5) + 1e-6).all()), float((err - bound).max())
    return float(err.max()), float(exact.abs().max())


@pytest.mark.parametrize("h", [1, 2])
def test_qgz_reduce_scatter_bounded(h):
    errors = run_distributed(_qgz_case, world_size=4, args=(h, 1100))
    assert all(0 < err < 0.2 * top for err, top in errors), errors  # quantized, and close


def test_node_tables():
    from deepspeed.utils.node_axis import check_node_size, effective_node_size, node_tables
    assert node_tables(((0, 1, 2, 3), ), 2) == (((0, 1), (2, 3)), ((0, 2), (1, 3)))
    # two model-parallel slots: the ZeRO groups are strided, nodes are runs of their members
    assert node_tables(((0, 2, 4, 6), (1, 3, 5, 7)),
                       2) == (((0, 2), (4, 6), (1, 3), (5, 7)), ((0, 4), (2, 6), (1, 5), (3, 7)))
    assert effective_node_size(8, 4) == 4 and effective_node_size(0, 4) == 1  # capped, as upstream
    with pytest.raises(ValueError, match="zero_hpz_partition_size"):
        check_node_size(4, 6)


# ------------------------------------------------------------------------------------------------ engines
class Net(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 33)
        self.b = torch.nn.Linear(33, 17)
        self.c = torch.nn.Linear(17, 1)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _config(gas=1, **zero):
    return {
        "train_micro_batch_size_per_gpu":
        4,
        "gradient_accumulation_steps":
        gas,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2
            }
        },
        "comms_logger": {
            "enabled": True,
            "prof_all": True
        },
        "zero_optimization":
        dict({
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 1
        }, **zero),
    }


def _batch(step, rank):
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 6, generator=gen)
    return x, (x.sum(dim=1, keepdim=True) * 0.3).sin()


def _records():
    from deepspeed.comm.timed import comms_logger
    return {name: {size: rec[0] for size, rec in sizes.items()} for name, sizes in comms_logger.comms_dict.items()}


def _train(steps, zero, record_groups=False, grads=True, gas=1):
    """Train ``steps`` steps; returns (losses, [per step: full grads], final full params, comms records, groups)."""
    import deepspeed
    from deepspeed.comm.timed import comms_logger
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
    torch.manual_seed(0)
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, config=_config(gas, **zero))
    comms_logger.comms_dict.clear()
    groups_seen = []
    fetch = engine.optimizer._stage.coordinator.fetch if hasattr(engine.optimizer, "_stage") else None
    if fetch is None:
        fetch = engine._stage.coordinator.fetch
    if record_groups and fetch.node_transport is not None:
        inner = fetch.node_transport.all_gather

        def recording(output, input, group):
            groups_seen.append(tuple(torch.distributed.get_process_group_ranks(group)))
            return inner(output, input, group)

        fetch.node_transport.all_gather = recording
    losses, full_grads = [], []
    rank = torch.distributed.get_rank()
    for step in range(steps * gas):
        x, y = _batch(step, rank)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        if grads and step % gas == gas - 1:
            comms_logger.enabled = False  # the accessors' gathers are not the training's
            full_grads.append({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()})
            comms_logger.enabled = True
        engine.step()
        losses.append(loss.item())
    records = _records()
    comms_logger.enabled = False
    params = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    comms_logger.comms_dict.clear()
    engine.destroy() if hasattr(engine, "destroy") else None
    return losses, full_grads, params, records, groups_seen


def _hpz_case(h, extra, gas):
    plain = _train(3, dict(extra), gas=gas)
    hpz = _train(3, dict(extra, zero_hpz_partition_size=h), record_groups=True, gas=gas)
    assert plain[0] == hpz[0], (plain[0], hpz[0])  # losses, bitwise
    for g_plain, g_hpz in zip(plain[1], hpz[1]):
        for name in g_plain:
            assert torch.equal(g_plain[name], g_hpz[name]), name
    for name in plain[2]:
        assert torch.equal(plain[2][name], hpz[2][name]), name
    return plain[3], hpz[3], hpz[4]


@pytest.mark.parametrize("world,h,extra,gas", [(4, 2, {}, 1), (2, 2, {}, 1), (2, 1, {}, 1),
                                               (4, 2, {
                                                   "offload_param": {
                                                       "device": "cpu"
                                                   },
                                                   "offload_optimizer": {
                                                       "device": "cpu"
                                                   }
                                               }, 2)])
def test_hpz_bitwise_and_node_gathers(world, h, extra, gas):
    results = run_distributed(_hpz_case, world_size=world, args=(h, extra, gas), timeout=180)
    plain, hpz, seen = results[0]
    node_name = "all_gather_into_tensor:hpz_node"
    primary = sum(plain["all_gather_into_tensor"].values())
    if h == 1:
        assert node_name not in hpz and hpz == plain
        return
    node_ranks = [tuple(range(r - r % h, r - r % h + h)) for r in range(world)]
    for rank, (_, _, groups) in enumerate(results):
        assert groups and all(g == node_ranks[rank] for g in groups), groups
    nodes = world // h
    # the backward gathers moved to the node group: as many gathers in all, N times fewer bytes each
    assert sum(hpz[node_name].values()) + sum(hpz["all_gather_into_tensor"].values()) == primary
    assert sum(hpz[node_name].values()) == len(seen) > 0
    assert set(hpz[node_name]) <= {size * nodes for size in plain["all_gather_into_tensor"]}


def _quant_case(zero, steps):
    exact = _train(steps, {}, grads=False)
    quant = _train(steps, zero, grads=False)
    return exact[0], quant[0], exact[3], quant[3]


def _unit_rows(world):
    """The unit row sizes (elements) of Net at ``world`` ranks, as the rank-major layout pads them."""
    model = Net()
    return sorted(
        {sum(-(-p.numel() // world) for p in m.parameters(recurse=False))
         for m in (model.a, model.b, model.c)})


@pytest.mark.parametrize("world,zero", [(4, {
    "zero_quantized_weights": True,
    "zero_quantized_gradients": True,
    "zero_hpz_partition_size": 2
}), (2, {
    "zero_quantized_weights": True,
    "zero_quantized_gradients": True
})])
def test_qwz_qgz_bytes_and_loss(world, zero):
    from deepspeed.runtime.zero.gradients import block_quant as bq
    steps = 50 if world == 4 else 25  # world 4 runs both of qgZ's hops and hpZ too
    results = run_distributed(_quant_case, world_size=world, args=(zero, steps), timeout=300)
    exact_losses, quant_losses, exact_rec, quant_rec = results[0]
    rows = _unit_rows(world)
    # exact: fp32 rows; qwZ: int8 blocks and scales
    assert set(exact_rec["all_gather_into_tensor"]) == {4 * c for c in rows}
    assert set(quant_rec["all_gather_into_tensor:qwZ"]) == {bq.row_bytes(c, 8, bq.WEIGHT_BLOCK) for c in rows}
    assert "all_gather_into_tensor" not in quant_rec
    assert set(exact_rec["reduce_scatter_tensor"]) == {4 * world * c for c in rows}
    assert "reduce_scatter_tensor" not in quant_rec
    if zero.get("zero_hpz_partition_size", 1) > 1:  # two hops: W rows in the node, N = W / h across nodes
        nodes = world // zero["zero_hpz_partition_size"]
        assert set(
            quant_rec["all_to_all_single:qgZ:node"]) == {world * bq.row_bytes(c, 4, bq.GRAD_BLOCK)
                                                         for c in rows}
        assert set(quant_rec["all_to_all_single:qgZ:cross_node"]) == {
            nodes * bq.row_bytes(c, 4, bq.GRAD_BLOCK)
            for c in rows
        }
        assert set(quant_rec["all_gather_into_tensor:qwZ:hpz_node"]) == {
            nodes * bq.row_bytes(c, 8, bq.WEIGHT_BLOCK)
            for c in rows
        }
    else:
        assert set(quant_rec["all_to_all_single:qgZ"]) == {world * bq.row_bytes(c, 4, bq.GRAD_BLOCK) for c in rows}
    exact_mean = sum(exact_losses) / steps
    assert abs(sum(quant_losses) / steps - exact_mean) <= 0.02 * exact_mean, (exact_losses, quant_losses)
    assert abs(quant_losses[-1] - exact_losses[-1]) <= 0.05 * exact_losses[0] + 0.05 * exact_losses[-1]
    assert quant_losses[-1] < 0.5 * quant_losses[0]  # it trains


# ------------------------------------------------------------------------------------------------ refusals
def _refused(zero, stage):
    import deepspeed
    cfg = _config(**zero)
    cfg["zero_optimization"]["stage"] = stage
    try:
        deepspeed.initialize(model=Net(), config=cfg)
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return f"{type(error).__name__}: {error}"
    return None


@pytest.mark.parametrize("zero,stage,words", [
    ({
        "zero_hpz_partition_size": 2
    }, 2, ["zero_hpz_partition_size", "stage 3"]),
    ({
        "zero_quantized_gradients": True
    }, 1, ["zero_quantized_gradients"]),
    ({
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 2
    }, 0, ["zero_quantized_weights", "zero_hpz_partition_size"]),
    ({
        "zero_quantized_gradients": True,
        "reduce_scatter": False
    }, 3, ["zero_quantized_gradients", "reduce_scatter"]),
    ({
        "zeropp_loco_param": {
            "err_beta": 0.8,
            "reset_T": 1024
        }
    }, 3, ["zeropp_loco_param"]),
    ({
        "zero_quantized_nontrainable_weights": True
    }, 2, ["zero_quantized_nontrainable_weights", "stage 3"]),
    ({
        "zero_hpz_partition_size": 3
    }, 3, ["zero_hpz_partition_size", "divide"]),
])
def test_refusals(zero, stage, words):
    messages = run_distributed(_refused,
                               world_size=4 if zero.get("zero_hpz_partition_size") == 3 else 2,
                               args=(zero, stage))
    for message in messages:  # every rank, the same refusal
        assert message is not None and all(w in message for w in words), message


def test_block_quant_native_matches_torch():
    """The host op (csrc/quantization/block_quant.cpp) packs and unpacks the torch reference's bits; registered for a
    CPU engine unless DS_NATIVE_BLOCK_QUANT=0, for a GPU engine only with DS_NATIVE_BLOCK_QUANT=1."""
    from deepspeed.ops import block_quant_native as native
    from deepspeed.ops.op_builder import builder as builder_module
    from deepspeed.runtime.zero.gradients import block_quant as bq
    if builder_module.cxx_compiler() is None:  # then the op cannot load and the reference stays
        assert native.load() is None and not native.register("cpu", {})
        return
    assert native.load() is not None
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        for bits in (4, 8):
            for rows, numel, block in [(1, 1, 2), (3, 7, 4), (2, 4097, 4096), (4, 1000, 512), (2, 5, 512)]:
                x = (torch.randn(rows, numel, generator=gen) * 10).to(dtype)
                x[0, 0] = 0.0
                packed = bq.torch_quantize_rows(x, bits, block)
                assert torch.equal(native.quantize_rows(x, bits, block), packed), (dtype, bits, rows, numel)
                ref, got = torch.empty_like(x), torch.empty_like(x)
                bq.torch_dequantize_rows(packed, numel, bits, block, ref)
                assert torch.equal(native.dequantize_rows(packed, numel, bits, block, got), ref)
    try:
        bq.reset()
        assert not native.register("cpu", {"DS_NATIVE_BLOCK_QUANT": "0"})
        assert not native.register("cuda", {}) and not native.register("cpu", {"DS_BLOCK_QUANT": "torch"})
        assert bq.implementation("quantize_rows") is bq.torch_quantize_rows
        assert native.register("cpu", {}) and native.register("cuda", {"DS_NATIVE_BLOCK_QUANT": "1"})
        assert bq.implementation("quantize_rows") is native.quantize_rows
    finally:
        bq.reset()
