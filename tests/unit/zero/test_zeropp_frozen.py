# SPDX-License-Identifier: Apache-2.0
"""ZeRO++ ``zero_quantized_nontrainable_weights`` on ZeRO-3: frozen weights stored and gathered as int8 blocks.

A LoRA-like model (frozen base weights, one trainable base bias so one unit mixes frozen and trainable
parameters, trainable low-rank adapters) against a plain-torch reference whose frozen weights are the
dequantized values, computed here from the quantizer's formula (each rank's shard on its own, blocks of
4096 values from the shard's start: ``scale = max|x| / 127``, ``q = round(x / scale)``, ``x' = q * scale``):

* the frozen shards are int8 codes with float32 scales (bytes counted) and no 16-bit frozen partition is kept;
* every all-gather's bytes are the frozen codes and scales plus the trainable columns in fp32 (comms logger);
* forward outputs bitwise the reference's; gradients and parameters after 3 SGD steps bitwise at world 2
  (within 1e-6 at world 4 with hpZ, where four rank gradients are summed in another order);
* ``GatheredParameters`` and the consolidated 16-bit state dict give the dequantized values;
* with the key off, the frozen weights are the exact ones (the reference with unquantized weights);
* a checkpoint restores the codes and scales bitwise into the same layout, the dequantized values into an engine
  without the key;
* seeded random widths (1-wide layers, frozen parameters smaller than the world) at worlds 1, 2 (bf16) and 4;
* with qwZ as well: every gather's bytes are the stored frozen codes plus qwZ's packed trainable row.
"""

import pytest
import torch

from tests.unit.common import run_distributed

D_IN, D_H, RANK = 64, 130, 3  # base1.weight: 8320 values, shards of 4160 (w2) / 2080 (w4): 2 blocks / 1 block


class LoRANet(torch.nn.Module):

    def __init__(self, d_in=D_IN, d_h=D_H, rank=RANK):
        super().__init__()
        self.base1 = torch.nn.Linear(d_in, d_h)
        self.a1 = torch.nn.Linear(d_in, rank, bias=False)
        self.b1 = torch.nn.Linear(rank, d_h, bias=False)
        self.base2 = torch.nn.Linear(d_h, 1)
        self.a2 = torch.nn.Linear(d_h, 1, bias=False)
        self.base1.weight.requires_grad_(False)
        self.base2.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.base1(x) + self.b1(self.a1(x)))
        return self.base2(h) + self.a2(h)


def _quantized(param, world):
    """What the engine's gathers give for a frozen ``param``: each rank's shard block-quantized on its own."""
    shard = -(-param.numel() // world)
    flat = torch.zeros(world * shard)
    flat[:param.numel()] = param.detach().reshape(-1)
    out = []
    for r in range(world):
        piece = flat[r * shard:(r + 1) * shard]
        for start in range(0, shard, 4096):
            block = piece[start:start + 4096]
            scale = block.abs().max() / 127
            safe = scale if scale > 0 else torch.ones(())
            out.append(torch.round(block / safe).clamp(-127, 127) * scale)
    return torch.cat(out)[:param.numel()].view(param.shape)


def _unit_row(module):
    """(trainable columns, [frozen shard sizes]) of the unit of ``module``'s own parameters."""
    own = list(module.parameters(recurse=False))
    return sum(p.ds_shard_numel for p in own
               if p.requires_grad), [p.ds_shard_numel for p in own if not p.requires_grad]


def _batch(step, rank):
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, D_IN, generator=gen)
    return x, x[:, :1].sin()


def _case(world, quantize, extra):
    import deepspeed
    from deepspeed.comm.timed import comms_logger
    from deepspeed.runtime.zero import GatheredParameters
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
    torch.manual_seed(0)
    model = LoRANet()
    torch.nn.init.normal_(model.b1.weight)  # nonzero adapters, so every adapter gets a gradient
    ref = LoRANet()
    ref.load_state_dict(model.state_dict())
    if quantize:
        with torch.no_grad():
            for p in ref.parameters():
                if not p.requires_grad:
                    p.copy_(_quantized(p, world))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    config = {
        "train_micro_batch_size_per_gpu":
        4,
        "gradient_clipping":
        0.0,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "comms_logger": {
            "enabled": True,
            "prof_all": True
        },
        "zero_optimization":
        dict(stage=3,
             stage3_param_persistence_threshold=0,
             stage3_prefetch_bucket_size=1,
             zero_quantized_nontrainable_weights=quantize,
             **extra),
    }
    engine, *_ = deepspeed.initialize(model=model,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)
    stage = engine.optimizer._stage if hasattr(engine.optimizer, "_stage") else engine._stage
    # memory: int8 codes and float32 scales per frozen shard, no 16-bit frozen partition
    frozen_bytes = None
    if quantize:
        assert stage.shards[-1] is None and stage.sources[-1] is None
        expect = 0
        for name, p in model.named_parameters():
            if name in frozen:
                assert p.ds_tensor.dtype == torch.int8 and p.ds_tensor.numel() == p.ds_shard_numel
                expect += p.ds_shard_numel + 4 * -(-p.ds_shard_numel // 4096)
        assert stage.frozen_store.nbytes() == expect
        frozen_bytes = expect
    else:
        assert all(p.ds_tensor.dtype == torch.float32 for p in model.parameters())
    rows = [_unit_row(m) for m in (model.base1, model.a1, model.b1, model.base2, model.a2)]
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    rank = torch.distributed.get_rank()
    comms_logger.comms_dict.clear()
    for step in range(3):
        x, y = _batch(step, rank)
        out = engine(x)
        want = ref(x)
        # bitwise; at world 4 after the first step within float rounding (rank gradients summed in another order)
        assert torch.equal(out, want) or (world > 2 and step > 0 and torch.allclose(out, want, rtol=1e-5, atol=1e-6))
        engine.backward(torch.nn.functional.mse_loss(out, y))
        comms_logger.enabled = False
        grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters() if n not in frozen}
        comms_logger.enabled = True
        engine.step()
        opt.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(ref(xr), yr) for xr, yr in (_batch(step, r) for r in range(world)))
        (loss / world).backward()
        for name, p in ref.named_parameters():
            if name in grads:
                close = torch.equal if world == 2 else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5))
                assert close(grads[name], p.grad), (name, float((grads[name] - p.grad).abs().max()))
        opt.step()
    comms_logger.enabled = False
    records = {name: sorted(sizes) for name, sizes in comms_logger.comms_dict.items()}
    for name, p in engine.module.named_parameters():
        value = safe_get_full_fp32_param(p)
        want = dict(ref.named_parameters())[name]
        if world == 2 or name in frozen:
            assert torch.equal(value, want), name
        else:
            assert torch.allclose(value, want, rtol=1e-5, atol=1e-6), name
        with GatheredParameters([p]):
            assert torch.equal(p.data, value) or (world != 2 and name not in frozen)
    if quantize:  # writing a frozen weight quantizes it again: a gather gives the quantized new value
        new = torch.linspace(-1, 2, model.base2.weight.ds_numel).view(model.base2.weight.ds_shape)
        with GatheredParameters([model.base2.weight], modifier_rank=0):
            model.base2.weight.data.copy_(new)
        assert torch.equal(safe_get_full_fp32_param(model.base2.weight), _quantized(new, world))
    state = engine._zero3_consolidated_16bit_state_dict()
    if rank == 0 and not quantize:
        assert torch.equal(state["base1.weight"], ref.base1.weight)
    if rank == 0 and quantize:
        assert torch.equal(state["base1.weight"], ref.base1.weight)
    engine.destroy() if hasattr(engine, "destroy") else None
    return records, rows, frozen_bytes


@pytest.mark.parametrize("world,extra", [(2, {}), (4, {"zero_hpz_partition_size": 2})])
def test_quantized_frozen_weights(world, extra):
    results = run_distributed(_case, world_size=world, args=(world, True, extra), timeout=180)
    records, rows, frozen_bytes = results[0]
    assert frozen_bytes < 0.26 * 4 * sum(f for _, frozen in rows for f in frozen)  # about a quarter of fp32
    sizes = {4 * trainable + sum(f + 4 * -(-f // 4096) for f in frozen) for trainable, frozen in rows}
    assert set(records["all_gather_into_tensor"]) == sizes  # every unit's row, frozen columns in int8 + scales
    if world == 4:  # hpZ: a backward gather in the node sends the N = 2 rows the forward received, as they came
        assert set(records["all_gather_into_tensor:hpz_node"]) <= {2 * s for s in sizes}
    gathers = {n for n in records if n.startswith("all_gather")}
    assert gathers <= {"all_gather_into_tensor", "all_gather_into_tensor:hpz_node"}


def test_key_off_unchanged():
    results = run_distributed(_case, world_size=2, args=(2, False, {}), timeout=180)
    records, rows, _ = results[0]
    assert set(records["all_gather_into_tensor"]) == {4 * (t + sum(f)) for t, f in rows}


def _loose_refused():
    import deepspeed
    model = LoRANet()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "zero_optimization": {
            "stage": 3,
            "zero_quantized_nontrainable_weights": True
        }
    }
    try:  # a2 requires a gradient but is given to no optimizer group
        deepspeed.initialize(model=model, model_parameters=[model.a1.weight, model.b1.weight], config=config)
    except NotImplementedError as error:
        return str(error)
    return None


def test_refusals():
    message = run_distributed(_loose_refused, world_size=1)[0]
    assert message and "zero_quantized_nontrainable_weights" in message and "optimizer" in message
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.units.zeropp import check_zeropp
    for device in ("cpu", "nvme"):
        zero = DeepSpeedZeroConfig(stage=3,
                                   zero_quantized_nontrainable_weights=True,
                                   offload_param={
                                       "device": device,
                                       "nvme_path": "/tmp"
                                   })
        with pytest.raises(NotImplementedError, match="zero_quantized_nontrainable_weights.*offload_param"):
            check_zeropp(zero, 3, 1)
    with pytest.raises(NotImplementedError, match="zero_quantized_nontrainable_weights"):
        check_zeropp(DeepSpeedZeroConfig(stage=2, zero_quantized_nontrainable_weights=True), 2, 1)
    assert check_zeropp(DeepSpeedZeroConfig(stage=3, zero_quantized_nontrainable_weights=True), 3,
                        1).quantized_nontrainable_weights


def _engine(quantize):
    import deepspeed
    torch.manual_seed(0)
    model = LoRANet()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "zero_quantized_nontrainable_weights": quantize
        },
    }
    engine, *_ = deepspeed.initialize(model=model,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)
    return engine


def _checkpoint_case(path):
    """Save with quantized frozen weights; load into the same layout (codes and scales restored bitwise) and into
    an engine without the key (its frozen weights are then the dequantized values)."""
    from deepspeed.utils import safe_get_full_fp32_param
    engine = _engine(True)
    with torch.no_grad():  # other frozen values than a fresh engine's: the load must bring them
        for p in engine.module.parameters():
            if not p.requires_grad:
                p.ds_quant_store.write_shard(p, torch.randn(p.ds_shard_numel) * 3)
    x, y = _batch(0, torch.distributed.get_rank())
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    saved = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    codes = {
        n: (p.ds_tensor.clone(), p.ds_tensor.ds_quant_scale.clone())
        for n, p in engine.module.named_parameters() if not p.requires_grad
    }
    engine.save_checkpoint(path, tag="t")
    for quantize in (True, False):
        other = _engine(quantize)
        other.load_checkpoint(path, tag="t")
        for n, p in other.module.named_parameters():
            assert torch.equal(safe_get_full_fp32_param(p), saved[n]), (quantize, n)
            if quantize and n in codes:
                assert torch.equal(p.ds_tensor, codes[n][0]) and torch.equal(p.ds_tensor.ds_quant_scale, codes[n][1])
    return True


def test_checkpoint_round_trip(tmp_path):
    assert all(run_distributed(_checkpoint_case, world_size=2, args=(str(tmp_path), ), timeout=180))


def _random_case(world, seed, dtype):
    """Seeded random widths (1-wide layers, frozen parameters smaller than the world; seeds 2, 10, 11 give 1x19x2,
    2x4x1 and 2x31x1), bf16 too: the first forward
    bitwise the reference's on the dequantized frozen weights, and a step trains the adapters only."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    gen = torch.Generator().manual_seed(seed)
    d_in, d_h, r = (int(torch.randint(1, hi, (), generator=gen)) for hi in (9, 70, 3))
    torch.manual_seed(seed)
    model = LoRANet(d_in, d_h, r).to(dtype)
    torch.nn.init.normal_(model.b1.weight)
    ref = LoRANet(d_in, d_h, r).to(dtype)
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in ref.parameters():
            if not p.requires_grad:
                p.copy_(_quantized(p.float(), world).to(dtype))
    frozen = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    config = {
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
            "stage3_prefetch_bucket_size": 1,
            "zero_quantized_nontrainable_weights": True
        },
    }
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)
    x = torch.randn(2, d_in, generator=torch.Generator().manual_seed(torch.distributed.get_rank())).to(dtype)
    out = engine(x)
    assert torch.equal(out, ref(x))
    engine.backward(out.float().square().mean())
    engine.step()
    for n, p in engine.module.named_parameters():
        value = safe_get_full_fp32_param(p)
        if n in frozen:
            assert torch.equal(value.to(dtype), frozen[n]), n
    assert torch.equal(engine(x), engine(x))  # gathers after the step: the frozen columns decode alike
    return (d_in, d_h, r)


@pytest.mark.parametrize("world,seed,dtype", [(1, 2, torch.float32), (2, 10, torch.bfloat16), (4, 11, torch.float32)])
def test_random_shapes(world, seed, dtype):
    shapes = run_distributed(_random_case, world_size=world, args=(world, seed, dtype), timeout=180)
    assert len(set(shapes)) == 1


def _qwz_case():
    """With qwZ too: the frozen codes travel as stored and the trainable columns as qwZ's int8 blocks."""
    import deepspeed
    from deepspeed.comm.timed import comms_logger
    torch.manual_seed(0)
    model = LoRANet()
    ref = LoRANet()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in ref.parameters():
            if not p.requires_grad:
                p.copy_(_quantized(p, 2))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "comms_logger": {
            "enabled": True,
            "prof_all": True
        },
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 1,
            "zero_quantized_nontrainable_weights": True,
            "zero_quantized_weights": True
        },
    }
    engine, *_ = deepspeed.initialize(model=model,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)
    comms_logger.comms_dict.clear()
    x, _ = _batch(0, torch.distributed.get_rank())
    out, want = engine(x), ref(x)
    comms_logger.enabled = False
    # only the adapters' gathers are lossy (half a step of their int8 blocks)
    assert not torch.equal(out, want) and torch.allclose(out, want, rtol=0.02, atol=0.02)
    return {name: sorted(sizes) for name, sizes in comms_logger.comms_dict.items()}, \
        [_unit_row(m) for m in (model.base1, model.a1, model.b1, model.base2, model.a2)]


def test_with_qwz():
    from deepspeed.runtime.zero.gradients import block_quant as bq
    records, rows = run_distributed(_qwz_case, world_size=2, timeout=180)[0]
    want = set()
    for trainable, frozen in rows:
        want.add(sum(f + 4 * -(-f // 4096) for f in frozen) + (bq.row_bytes(trainable, 8, 4096) if trainable else 0))
    assert set(records["all_gather_into_tensor:qwZ"]) == want and "all_gather_into_tensor" not in records
