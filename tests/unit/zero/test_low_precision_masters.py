# SPDX-License-Identifier: Apache-2.0
"""16-bit master weights and optimizer state (``bf16.bf16_master_weights_and_grads``, ``bf16.bf16_optimizer_states``,
``fp16.fp16_master_weights_and_grads``) on ZeRO stages 1-3.

Reference: plain torch keeping the same dtypes. Every rank trains on the same batch, so the window gradient (each
rank's gradient times 1/2, summed) equals one rank's 16-bit gradient exactly; the reference steps a 16-bit copy of
the parameters with that gradient and an optimizer of the same class, and parameters, masters and moments must be
bitwise equal after several steps. Memory: the bytes of the masters and optimizer state per parameter element
are counted on every rank.
"""

import copy

import pytest
import torch

import deepspeed
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.config_utils import DeepSpeedConfigError
from deepspeed.runtime.zero.stages import StageConfig
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from tests.unit.common import run_distributed

STEPS = 3
LR = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)


def _model(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(torch.randint(1, 9, (1, ), generator=gen)) for _ in range(2)]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, sizes[0]), torch.nn.Tanh(), torch.nn.Linear(sizes[0], 1),
                                torch.nn.Linear(1, sizes[1]))  # a 1-wide layer; a bias smaller than the world
    return model.to(dtype)


def _optimizer(kind, params):
    if kind == "cpu_adam_16":
        return DeepSpeedCPUAdam(params, fp32_optimizer_states=False, **LR)
    if kind == "cpu_adam":
        return DeepSpeedCPUAdam(params, **LR)
    return torch.optim.AdamW(params, foreach=False, **LR)  # "torch", "torch_fp32_window"


def _train(stage, precision, offload, kind, seed):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    model = _model(seed, dtype)
    reference = copy.deepcopy(model)
    section = {"enabled": True}
    if precision == "bf16":
        section.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=kind != "cpu_adam")
    else:
        section.update(fp16_master_weights_and_grads=True, loss_scale=1.0)
    zero = {"stage": stage, "reduce_bucket_size": 16}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    data_types = {"grad_accum_dtype": "fp32"} if kind == "torch_fp32_window" else {}
    config = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_clipping": 0.0,
        precision: section,
        "zero_optimization": zero,
        "data_types": data_types
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_optimizer(kind, model.parameters()), config=config)

    masters = [p.detach().clone() for p in reference.parameters()]  # the reference's 16-bit masters
    ref_opt = _optimizer(kind, masters)
    gen = torch.Generator().manual_seed(seed + 1)  # the same batches on every rank
    for _ in range(STEPS):
        x = torch.randn(3, 7, generator=gen).to(dtype)
        loss = engine(x).float().pow(2).sum()
        engine.backward(loss)
        engine.step()
        reference.zero_grad()
        reference(x).float().pow(2).sum().backward()
        for master, param in zip(masters, reference.parameters()):
            master.grad = param.grad.clone()
        ref_opt.step()
        with torch.no_grad():
            for master, param in zip(masters, reference.parameters()):
                param.copy_(master)

    mismatches = []
    for i, (param, master) in enumerate(zip(engine.module.parameters(), masters)):
        if not torch.equal(safe_get_full_fp32_param(param), master.float()):
            mismatches.append(f"master {i}")
        for key in ("exp_avg", "exp_avg_sq"):
            ours, theirs = safe_get_full_optimizer_state(param, key), ref_opt.state[master][key]
            if theirs.dtype != torch.float32:
                same = torch.equal(ours, theirs.float())
            else:  # float32 moments: the host kernel's vector and scalar paths round an element differently when
                # its offset in the stepped tensor differs (a partition, not the whole parameter): one ulp
                same = bool(((ours - theirs).abs() <= 2**-22 * theirs.abs()).all())
            if not same:
                mismatches.append(f"{key} {i}")
    if stage < 3:
        for i, (param, ref) in enumerate(zip(engine.module.parameters(), reference.parameters())):
            if not torch.equal(param.detach(), ref.detach()):
                mismatches.append(f"model parameter {i}")

    stage_obj = engine._stage
    numel = sum(m.numel() for m in stage_obj.masters)
    nbytes = sum(m.numel() * m.element_size() for m in stage_obj.masters)
    state_dtypes = set()
    for m in stage_obj.masters:
        for value in engine.basic_optimizer.state.get(m, {}).values():
            if torch.is_tensor(value) and value.numel() == m.numel() and value.numel() > 1:
                nbytes += value.numel() * value.element_size()
                state_dtypes.add(value.dtype)
    master_dtypes = {m.dtype for m in stage_obj.masters}
    grad_dtypes = {g.dtype for g in stage_obj.grad_parts}
    engine.destroy()
    return mismatches, nbytes / max(numel, 1), master_dtypes, state_dtypes, grad_dtypes


# (stage, precision, offload, optimizer, bytes per parameter of masters + Adam state; fp32 masters and state: 12)
CASES = [
    (1, "bf16", False, "torch", 6.0),
    (2, "bf16", False, "torch", 6.0),
    (3, "bf16", False, "torch", 6.0),
    (2, "bf16", False, "torch_fp32_window", 6.0),  # an fp32 window gradient, rounded to bf16 for each step
    (2, "bf16", True, "cpu_adam_16", 6.0),
    (3, "bf16", True, "cpu_adam", 10.0),  # bf16 masters, fp32 moments (DeepSpeedCPUAdam's default)
    (1, "fp16", True, "cpu_adam", 10.0),
]


@pytest.mark.parametrize("stage,precision,offload,kind,per_param", CASES)
def test_step_equals_16bit_reference(stage, precision, offload, kind, per_param):
    seed = 100 + stage * 10 + len(kind)
    results = run_distributed(_train, 2, args=(stage, precision, offload, kind, seed), timeout=120)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    for mismatches, bytes_per_param, master_dtypes, state_dtypes, grad_dtypes in results:
        assert mismatches == []
        assert master_dtypes == {dtype}
        assert grad_dtypes == ({torch.float32} if kind == "torch_fp32_window" else {dtype})  # "and_grads"
        assert state_dtypes == ({dtype} if per_param == 6.0 else {torch.float32})
        assert bytes_per_param == per_param


def _stage_config(fragment, stage=2, offload=None):
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": offload, "nvme_path": "/tmp"}
    config = DeepSpeedConfig(dict({"train_batch_size": 2, "zero_optimization": zero}, **fragment), world_size=1)
    return StageConfig.from_ds_config(config, torch.bfloat16)


def test_master_dtype_from_config():
    assert _stage_config({"bf16": {"enabled": True}}).master_dtype == torch.float32
    both = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
    config = _stage_config(both)
    assert config.master_dtype == torch.bfloat16 and config.states_16bit
    config = _stage_config({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, offload="cpu")
    assert config.master_dtype == torch.bfloat16 and not config.states_16bit


@pytest.mark.parametrize(
    "fragment,offload,error,words",
    [
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, None, DeepSpeedConfigError,
         "bf16.bf16_master_weights_and_grads"),  # fp32 moments of bf16 masters need the host optimizer
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, None, DeepSpeedConfigError,
         "fp16.fp16_master_weights_and_grads"),
        ({"bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}, None,
         DeepSpeedConfigError, "bf16.enabled"),
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "nvme", NotImplementedError, "nvme"),
    ])  # yapf: disable
def test_refused_combinations(fragment, offload, error, words):
    with pytest.raises(error, match=words):
        _stage_config(fragment, offload=offload)


def _cpu_adam(fp32_optimizer_states):
    """A DeepSpeedCPUAdam for the type and attribute checks, without building its host op (seconds)."""
    optimizer = DeepSpeedCPUAdam.__new__(DeepSpeedCPUAdam)
    optimizer.fp32_optimizer_states = fp32_optimizer_states
    return optimizer


def test_optimizer_rules():
    from deepspeed.runtime.precision.low_precision_masters import check_optimizer
    offloaded = _stage_config(
        {"bf16": {
            "enabled": True,
            "bf16_master_weights_and_grads": True,
            "bf16_optimizer_states": True
        }},
        offload="cpu")
    adamw = torch.optim.AdamW.__new__(torch.optim.AdamW)  # its type is what is checked (no dynamo import)
    with pytest.raises(DeepSpeedConfigError, match="DeepSpeedCPUAdam"):
        check_optimizer(offloaded, adamw)
    with pytest.raises(DeepSpeedConfigError, match="fp32_optimizer_states=False"):
        check_optimizer(offloaded, _cpu_adam(True))
    check_optimizer(offloaded, _cpu_adam(False))
    on_device = _stage_config(
        {"bf16": {
            "enabled": True,
            "bf16_master_weights_and_grads": True,
            "bf16_optimizer_states": True
        }})
    check_optimizer(on_device, adamw)
    with pytest.raises(DeepSpeedConfigError, match="fp32_optimizer_states=True"):
        check_optimizer(on_device, _cpu_adam(True))


def _resume(stage, path, seed):
    import deepspeed
    config = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_clipping": 1.0,
        "bf16": {
            "enabled": True,
            "bf16_master_weights_and_grads": True,
            "bf16_optimizer_states": True
        },
        "zero_optimization": {
            "stage": stage
        },
        "optimizer": {
            "type": "AdamW",
            "params": LR
        }
    }
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randn(3, 7, generator=gen).bfloat16() for _ in range(3)]

    def train(engine, xs):
        for x in xs:
            engine.backward(engine(x).float().pow(2).sum())
            engine.step()
        return [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]

    engine, _, _, _ = deepspeed.initialize(model=_model(seed, torch.bfloat16), config=config)
    train(engine, batches[:2])
    engine.save_checkpoint(path, tag="t")
    expected = train(engine, batches[2:])
    engine.destroy()
    other = _model(seed, torch.bfloat16)  # the same shapes, other values: the load must bring them back
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    engine, _, _, _ = deepspeed.initialize(model=other, config=config)
    engine.load_checkpoint(path, tag="t")
    masters = {m.dtype for m in engine._stage.masters}
    actual = train(engine, batches[2:])
    engine.destroy()
    return all(torch.equal(a, e) for a, e in zip(actual, expected)), masters


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_round_trip(stage, tmp_path):
    for same, masters in run_distributed(_resume, 2, args=(stage, str(tmp_path), 40 + stage), timeout=120):
        assert same and masters == {torch.bfloat16}
