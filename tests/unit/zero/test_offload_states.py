# SPDX-License-Identifier: Apache-2.0
"""``engine.offload_states()`` / ``reload_states()``: the call sequences of RL trainers, bitwise against a run
that never offloads.

* OpenRLHF's sleep mode (``--deepspeed_enable_sleep``): after the actor's training step,
  ``actor.optimizer.offload_states(include=[optim_states, contiguous_grad_buffer, hp_params, lp_grads],
  non_blocking=True)`` and ``empty_partition_cache()``; the weights are then read for the inference engine
  (``GatheredParameters`` over every parameter) while the masters are away; the reference model (an engine
  without optimizer) is emptied too; both are reloaded before the next experience step.
* ROLL's strategy: ``offload_states()`` of everything after every optimizer step, ``reload_states()`` before the
  next forward; checked also with the host step pipelined (``offload_optimizer``) and with parameter offload.

Seeded random cases (random widths with a 1x1 layer, a parameter smaller than the world of 3; stages 0-3) offload
random subsets, some twice, forward when the parameters stayed, reload once or twice.

After a full offload the device storages reachable from the engine (a walk over its object graph, independent of
the state table) hold no more than a few bytes. Every loss, every reference output, the weights read while the
masters are offloaded and the final fp32 masters must be bit-identical to the never-offloaded run's.
"""

import pytest
import torch

from tests.unit.common import run_distributed


class _Net(torch.nn.Module):
    """Odd widths, a 1-wide layer."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 9)
        self.b = torch.nn.Linear(9, 1)
        self.c = torch.nn.Linear(1, 3)

    def forward(self, x):
        return self.c(self.b(torch.tanh(self.a(x))))


def _config(stage, dtype, optimizer=True, extra=None):
    cfg = {
        "train_micro_batch_size_per_gpu":
        2,
        "gradient_accumulation_steps":
        2 if optimizer else 1,
        "gradient_clipping":
        1.0,
        "bf16": {
            "enabled": dtype == "bf16"
        },
        "zero_optimization":
        dict(
            {
                "stage": stage,
                "stage3_param_persistence_threshold": 10,
                "stage3_prefetch_bucket_size": 20,
                "reduce_bucket_size": 30
            }, **(extra or {})),
    }
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-2, "weight_decay": 0.1}}
    return cfg


def _ours(obj):
    """Objects the walk enters: modules, optimizers and this package's (or the tests') objects."""
    return isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)) or type(obj).__module__.startswith(
        ("deepspeed", "tests"))


def reachable_device_bytes(engine):
    """Bytes of the distinct non-empty storages on the engine's device reachable from it (its attributes, the
    model's parameters and their gradients and ZeRO attributes, the optimizers' state), the host copy of
    ``offload_states`` left out."""
    placement = engine._states.placement
    skip = {placement._host.untyped_storage().data_ptr()} if placement._host is not None else set()
    seen, storages, stack = set(), {}, [engine]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is placement:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if obj.device == engine.device and storage.data_ptr() not in skip and storage.nbytes():
                storages[storage.data_ptr()] = storage.nbytes()
            stack.append(obj.grad)
            stack.extend(getattr(obj, "__dict__", {}).values())
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif _ours(obj):
            stack.extend(getattr(obj, "__dict__", {}).values())
            for klass in type(obj).__mro__:
                for slot in getattr(klass, "__slots__", ()):
                    stack.append(getattr(obj, slot, None))
    return sum(storages.values())


def _batch(generator, dtype):
    return torch.randn(2, 5, generator=generator).to(torch.bfloat16 if dtype == "bf16" else torch.float32)


def _weights(engine):
    """Every parameter's full 16-bit value, read the way OpenRLHF hands weights to vLLM."""
    import deepspeed
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return [p.detach().clone() for p in params]


def rl_loop(stage, dtype, recipe, offload, steps=3, extra=None):
    """The RL loop of ``recipe`` ("openrlhf" or "roll"), offloading or not; everything it observed."""
    import deepspeed
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum as K
    from deepspeed.utils import safe_get_full_fp32_param
    torch.manual_seed(11)
    actor = deepspeed.initialize(model=_Net(), config=_config(stage, dtype, extra=extra))[0]
    torch.manual_seed(12)
    ref_stage = stage if recipe == "openrlhf" else 0
    ref = deepspeed.initialize(model=_Net(), config=_config(ref_stage, dtype, optimizer=False))[0]
    generator = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    seen = {"loss": [], "ref": [], "weights": [], "left": []}
    for _ in range(steps):
        with torch.no_grad():  # experience: the reference model's log-probs
            seen["ref"].append(ref(_batch(generator, dtype)).float())
        for _ in range(actor.gradient_accumulation_steps()):
            loss = actor(_batch(generator, dtype)).float().pow(2).mean()
            actor.backward(loss)
            actor.step()
            seen["loss"].append(loss.detach())
        if recipe == "openrlhf":
            if offload:
                actor.optimizer.offload_states(
                    include=[K.optim_states, K.contiguous_grad_buffer, K.hp_params, K.lp_grads],
                    device=OffloadDeviceEnum.cpu,
                    pin_memory=True,
                    non_blocking=True)
                actor.empty_partition_cache()
                ref.offload_states()
                seen["left"].append(reachable_device_bytes(ref))
            seen["weights"].append(_weights(actor))  # broadcast to the inference engine, masters away
            if offload:
                actor.reload_states(non_blocking=True)
                ref.reload_states()
        else:
            if offload:
                actor.offload_states()
                seen["left"].append(actor._states.device_bytes())
                if not (extra or {}):  # the walk cannot tell host-tier state from device state on a CPU machine
                    seen["left"].append(reachable_device_bytes(actor))
                actor.reload_states()
    seen["masters"] = [safe_get_full_fp32_param(p).clone() for p in actor.module.parameters()]
    actor.destroy()
    ref.destroy()
    return seen


def replay(stage, dtype, recipe, extra=None):
    plain = rl_loop(stage, dtype, recipe, offload=False, extra=extra)
    moved = rl_loop(stage, dtype, recipe, offload=True, extra=extra)
    mismatches = [
        key for key in ("loss", "ref", "masters")
        if not all(torch.equal(a, b) for a, b in zip(plain[key], moved[key]))
    ]
    if not all(torch.equal(a, b) for x, y in zip(plain["weights"], moved["weights"]) for a, b in zip(x, y)):
        mismatches.append("weights")
    return mismatches, max(moved["left"] or [0])


CELLS = [(1, "bf16", "openrlhf", None), (2, "fp32", "openrlhf", None), (3, "bf16", "openrlhf", None),
         (0, "fp32", "roll", None), (1, "bf16", "roll", None), (3, "fp32", "roll", None),
         (2, "bf16", "roll", {
             "offload_optimizer": {
                 "device": "cpu"
             }
         }), (3, "bf16", "roll", {
             "offload_optimizer": {
                 "device": "cpu"
             },
             "offload_param": {
                 "device": "cpu"
             }
         })]


@pytest.mark.parametrize("stage,dtype,recipe,extra",
                         CELLS,
                         ids=[f"{r}-z{s}-{d}{'-offload' if e else ''}" for s, d, r, e in CELLS])
def test_rl_offload_replay_is_bitwise(stage, dtype, recipe, extra):
    results = run_distributed(replay, 2, args=(stage, dtype, recipe, extra), timeout=180)
    for mismatches, left in results:
        assert mismatches == [], mismatches
        assert left <= 64, f"{left} bytes of engine state left on the device after a full offload"


def edge_cases():
    """Offloading twice, reloading twice, subsets, and what needs the state while it is away."""
    import deepspeed
    from deepspeed.runtime.engine_parts.usage_errors import EngineUsageError
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as K
    from deepspeed.runtime.zero.offload_states import get_state_devices
    torch.manual_seed(3)
    engine = deepspeed.initialize(model=_Net(), config=_config(3, "fp32"))[0]
    x = torch.randn(2, 5)
    for _ in range(2):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    dev, cpu = {engine.device}, {torch.device("cpu")}
    out = {}
    before = engine._states.device_bytes()
    engine.offload_states(include=[K.optim_states])
    out["subset"] = (get_state_devices(engine, K.optim_states) == cpu and engine._states.device_bytes() < before)
    with torch.no_grad():
        y = engine(x)  # the parameters stayed
    try:
        engine.step()  # the boundary step needs the optimizer state
        out["step_refused"] = False
    except EngineUsageError as error:
        out["step_refused"] = "reload_states" in str(error) and "optim_states" in str(error)
    engine.offload_states()  # the rest now; the optimizer state stays where it is
    engine.offload_states()  # nothing left to move
    out["all"] = engine._states.device_bytes() == 0 and all(get_state_devices(engine, k) <= cpu for k in K)
    for call in (lambda: engine(x), lambda: engine.backward(y.sum()), lambda: engine.zero_grad()):
        try:
            call()
            out.setdefault("refused", []).append(False)
        except EngineUsageError as error:
            out.setdefault("refused", []).append("reload_states" in str(error))
    try:
        engine.offload_states(device="nvme")
        out["nvme"] = False
    except ValueError:
        out["nvme"] = True
    engine.reload_states()
    engine.reload_states()  # nothing offloaded: nothing happens
    out["back"] = get_state_devices(engine, K.hp_params) == dev and get_state_devices(engine, K.lp_params) == dev
    with torch.no_grad():
        out["same_forward"] = torch.equal(engine(x), y)
    engine.destroy()
    return out


def test_offload_edge_cases():
    out = run_distributed(edge_cases, 1, timeout=90)[0]
    assert out == {
        "subset": True,
        "step_refused": True,
        "all": True,
        "refused": [True, True, True],
        "nvme": True,
        "back": True,
        "same_forward": True
    }


class _RandomNet(torch.nn.Module):
    """Random widths from ``generator``; a 1x1 layer (a parameter smaller than the world)."""

    def __init__(self, generator):
        super().__init__()
        widths = [5] + [int(w) for w in torch.randint(1, 10, (3, ), generator=generator)] + [1]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.tail = torch.nn.Linear(1, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.tail(x)


def random_cycles(seed, offload):
    """A seeded random engine (stage, precision, widths) trained 3 windows; after each, random subsets of the
    states offloaded (some twice), a forward when the parameters stayed, reloads (some twice). Returns the
    losses, the forwards' outputs by window and the final masters."""
    import deepspeed
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as K
    from deepspeed.utils import safe_get_full_fp32_param
    pick = torch.Generator().manual_seed(seed)
    stage = int(torch.randint(0, 4, (1, ), generator=pick))
    dtype = ("fp32", "bf16")[int(torch.randint(0, 2, (1, ), generator=pick))]
    torch.manual_seed(seed)
    engine = deepspeed.initialize(model=_RandomNet(pick), config=_config(stage, dtype))[0]
    data = torch.Generator().manual_seed(seed + torch.distributed.get_rank())
    losses, outputs = [], {}
    for window in range(3):
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(_batch(data, dtype)).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        subsets = [[k for k in K if bool(torch.rand(1, generator=pick) < 0.5)] for _ in range(2)]
        reloads = 1 + int(torch.randint(0, 2, (1, ), generator=pick))
        x = _batch(data, dtype)
        if offload:
            for subset in subsets + subsets[:1]:
                engine.offload_states(include=subset)
        if K.lp_params not in engine._states.placement.offloaded_kinds():
            with torch.no_grad():
                outputs[window] = engine(x).float()
        if offload:
            for _ in range(reloads):
                engine.reload_states()
    masters = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    engine.destroy()
    return (stage, dtype), losses, outputs, masters


def random_replay(seed):
    cell, *plain = random_cycles(seed, False)
    _, *moved = random_cycles(seed, True)
    same = all(torch.equal(a, b) for a, b in zip(plain[0], moved[0])) and len(plain[0]) == len(moved[0])
    same = same and all(torch.equal(plain[1][w], out) for w, out in moved[1].items())
    same = same and all(torch.equal(a, b) for a, b in zip(plain[2], moved[2]))
    return cell, same


@pytest.mark.parametrize("seed", [0, 1, 6, 12])  # stages 0, 1, 2, 3 (bf16)
def test_random_offload_cycles_world3(seed):
    for (stage, dtype), same in run_distributed(random_replay, 3, args=(seed, ), timeout=120):
        assert same, (seed, stage, dtype)
