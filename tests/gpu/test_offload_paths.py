# SPDX-License-Identifier: Apache-2.0
"""Offload on one GPU: the pinned/stream path gives the same numbers as the plain path, and the contract holds.

Two checks, in one process (world 1, NCCL; ``DS_GPU_TESTS_ON_CPU=1`` runs them on the CPU over gloo):

* *paths*: each offload configuration (ZeRO-1/2 optimizer offload, pinned and pageable; ZeRO-3
  optimizer and parameter offload, pinned and through the staging ring; ZenFlow, overlapped and
  with its device part offloaded) trains the same model twice from the same weights on the
  same data: once with the asynchronous path (side streams, events, host worker threads), once
  with ``DS_OFFLOAD_SYNC=1`` (every copy a plain blocking one). Every parameter must be equal,
  bit for bit, after every step: the streams only change when copies happen, never what they
  copy;
* *overlap*: the pipelined offloaded step (buckets stepped in forward order and uploaded as each is
  done, clipping in the host Adam op, the next forward overlapping the last buckets; each piece slowed
  by 5 ms so that the forward really runs ahead of the host) against ``DS_OFFLOAD_OVERLAP=0`` (the
  whole-partition step), and partial offload (``offload_optimizer.ratio``, the device share stepped by
  torch operations on the GPU) against full offload: bit-identical parameters, fp32 masters and Adam
  moments after every step;
* *contract*: cells of the gradient contract (``tests.unit.contract.runner.run_cell``) with
  offload on the GPU (stages 1-3, GAS 1 and 4, bf16 and fp16, several backward calls per step)
  against the plain-torch reference.

* ``python -m pytest tests/gpu/test_offload_paths.py`` : one test per case; skipped without CUDA;
* ``python -m tests.gpu.test_offload_paths [SUBSTRING...]`` : one line per case, then ``N passed, M failed``.
"""

import contextlib
import copy
import os
import socket
import sys
import time
import traceback

import pytest
import torch
import torch.nn.functional as F

ON_CPU = os.environ.get("DS_GPU_TESTS_ON_CPU") == "1"
pytestmark = pytest.mark.gpu

PIN = {"device": "cpu", "pin_memory": True}
PAGEABLE = {"device": "cpu", "pin_memory": False}
SMALL_UNITS = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 2000}
ZENFLOW = {"topk_ratio": 0.2, "update_interval": 2, "select_strategy": "step", "select_interval": 4}

PATH_CASES = {
    "z1-offload-pinned-gas4":
    dict(stage=1, gas=4, zero={"offload_optimizer": PIN}),
    "z2-offload-pinned-gas4":
    dict(stage=2, gas=4, zero={"offload_optimizer": PIN}),
    "z2-offload-pageable-gas2":
    dict(stage=2, gas=2, zero={"offload_optimizer": PAGEABLE}),
    "z2-offload-pinned-fp16":
    dict(stage=2, gas=2, dtype="fp16", zero={"offload_optimizer": PIN}),
    "z3-offload-both-pinned":
    dict(stage=3, gas=2, zero=dict(SMALL_UNITS, offload_optimizer=PIN, offload_param=PIN)),
    "z3-offload-param-ring":
    dict(stage=3,
         gas=2,
         zero=dict(SMALL_UNITS, offload_optimizer=PIN, offload_param=dict(PAGEABLE, buffer_count=2, buffer_size=700))),
    "z3-offload-optimizer-only":
    dict(stage=3, gas=1, zero=dict(SMALL_UNITS, offload_optimizer=PIN)),
    "zenflow-overlap":
    dict(stage=2, gas=2, zero={
        "offload_optimizer": PIN,
        "zenflow": dict(ZENFLOW, overlap_step=True)
    }),
    "zenflow-device-part-offload":
    dict(stage=2,
         gas=1,
         zero={
             "offload_optimizer": PIN,
             "zenflow": dict(ZENFLOW, offload=True, full_warm_up_rounds=1)
         }),
}

CONTRACT_CELLS = []
for _stage in (1, 2, 3):
    for _shape, _dtype, _gas in (("plain", "bf16", 1), ("n_backward_per_step", "bf16", 4), ("plain", "fp16", 4),
                                 ("two_losses_retained", "bf16", 4)):
        _extra = {"offload_optimizer": PIN, "overlap_comm": True}
        if _stage == 3:
            _extra.update(SMALL_UNITS, stage3_prefetch_bucket_size=100, offload_param=PIN)
        CONTRACT_CELLS.append(
            dict(id=f"contract-z{_stage}-{_shape}-{_dtype}-gas{_gas}",
                 stage=_stage,
                 shape=_shape,
                 dtype=_dtype,
                 gas=_gas,
                 bucket=64,
                 zero_extra=_extra))


class _Model(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.head = torch.nn.Linear(32, 64)

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def _config(case):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": case["gas"],
        "gradient_clipping": 1.0,
        "steps_per_print": float("inf"),
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-2
            }
        },
        "zero_optimization": dict({
            "stage": case["stage"],
            "reduce_bucket_size": 700
        }, **case["zero"]),
    }
    if case.get("dtype", "bf16") == "bf16":
        cfg["bf16"] = {"enabled": True}
    else:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


OVERLAP_CASES = {
    "z2-gas2": (dict(stage=2, gas=2, zero={"offload_optimizer": PIN}), None),
    "z1-gas1": (dict(stage=1, gas=1, zero={"offload_optimizer": PIN}), None),
    "z3-both-gas2": (dict(stage=3, gas=2, zero=dict(SMALL_UNITS, offload_optimizer=PIN, offload_param=PIN)), None),
    "z3-ratio0.5-vs-full": (dict(stage=3, gas=2, zero=dict(SMALL_UNITS, offload_optimizer=PIN)), 0.5),
    "z3-ratio0-both-vs-full": (dict(stage=3, gas=1, zero=dict(SMALL_UNITS, offload_optimizer=PIN,
                                                              offload_param=PIN)), 0.0),
}


@contextlib.contextmanager
def _environment(values):
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _sync_copies(enabled):
    return _environment({"DS_OFFLOAD_SYNC": "1" if enabled else "0"})


def _train(case, device, sync, steps=4, env=None, with_state=False):
    import deepspeed
    torch.manual_seed(0)
    model = _Model()
    history = []
    with _sync_copies(sync), _environment(env or {}):
        engine = deepspeed.initialize(model=copy.deepcopy(model), config=_config(case))[0]
        try:
            for step in range(steps):
                for micro in range(case["gas"]):
                    gen = torch.Generator().manual_seed(100 * step + micro)
                    tokens = torch.randint(0, 64, (4, 16), generator=gen).to(device)
                    logits = engine(tokens)
                    loss = F.cross_entropy(logits.float().reshape(-1, 64), tokens.roll(1, 1).reshape(-1))
                    engine.backward(loss)
                    engine.step()
                if case["stage"] == 3:
                    from deepspeed.utils import safe_get_full_fp32_param
                    history.append([safe_get_full_fp32_param(p).detach().cpu() for p in engine.module.parameters()])
                else:  # state_dict() waits for a step still running in the background
                    history.append([v.detach().float().cpu().clone() for v in engine.module.state_dict().values()])
                if with_state:
                    stage = engine._stage
                    stage._masters_current()
                    state = [m.detach().cpu().clone() for m in stage.masters]
                    for master in stage.masters:
                        entry = stage.optimizer.state.get(master, {})
                        state += [entry[k].detach().cpu().clone() for k in ("exp_avg", "exp_avg_sq") if k in entry]
                    history[-1] += state
        finally:
            engine.destroy()
    return history


def check_paths(name):
    """Streamed and synchronous copies give bit-identical parameters after every step."""
    case = PATH_CASES[name]
    device = _device()
    streamed = _train(case, device, sync=False)
    plain = _train(case, device, sync=True)
    for step, (a, b) in enumerate(zip(streamed, plain)):
        for index, (x, y) in enumerate(zip(a, b)):
            if not torch.equal(x, y):
                diff = (x - y).abs().max().item()
                raise AssertionError(f"{name}: step {step} parameter {index} differs between the stream path and the "
                                     f"plain path (max abs diff {diff:g})")
    moved = any(not torch.equal(x, y) for x, y in zip(streamed[0], streamed[-1]))
    assert moved, f"{name}: parameters did not change over the run"
    return f"{len(streamed)} steps identical"


def check_overlap(name):
    """The pipelined (overlapped) step, or partial offload, against the whole-partition full-offload step."""
    from deepspeed.runtime.zero.offload.step_pipeline import StepPipeline
    case, ratio = OVERLAP_CASES[name]
    device = _device()
    reference = _train(case, device, sync=False, env={"DS_OFFLOAD_OVERLAP": "0"}, with_state=True)
    if ratio is not None:
        case = copy.deepcopy(case)
        case["zero"]["offload_optimizer"] = dict(case["zero"]["offload_optimizer"], ratio=ratio)
    StepPipeline.piece_delay = 0.005
    try:
        tested = _train(case, device, sync=False, env={"DS_OFFLOAD_OVERLAP": "1"}, with_state=True)
    finally:
        StepPipeline.piece_delay = 0.0
    for step, (a, b) in enumerate(zip(tested, reference)):
        assert len(a) == len(b), f"{name}: step {step}: {len(a)} tensors against {len(b)}"
        for index, (x, y) in enumerate(zip(a, b)):
            if not torch.equal(x, y):
                diff = (x.float() - y.float()).abs().max().item()
                raise AssertionError(f"{name}: step {step} tensor {index} differs from the whole-partition step "
                                     f"(max abs diff {diff:g})")
    return f"{len(tested)} steps identical (parameters, masters, moments)"


def check_transfer_ordering(_):
    """A device-to-host copy issued while the compute stream is still writing its source reads the written values
    (the copy's stream waits for the compute stream: what a gradient copy after its reduction relies on)."""
    from deepspeed.runtime.zero.offload.transfers import HostTransfers, pinned_empty
    device = _device()
    transfers = HostTransfers(device)
    src = torch.zeros(1 << 20, device=device)
    dst = pinned_empty(src.numel(), torch.float32)
    for value in (1.0, 2.0, 3.0):
        if device.type == "cuda":
            torch.cuda._sleep(50_000_000)  # keep the compute stream busy (tens of ms) before it writes the source
        src.fill_(value)
        transfers.copy(dst, src).synchronize()
        assert bool((dst == value).all()), f"the copy read the source before the compute stream wrote {value}"
    return "3 copies ordered after their producer"


def check_contract(cell_id):
    from tests.unit.contract.runner import run_cell
    cell = dict(next(c for c in CONTRACT_CELLS if c["id"] == cell_id))
    cell.pop("id")
    cell["device"] = "cpu" if ON_CPU else "cuda"
    if cell["stage"] == 3:
        cell["zero_init"] = True
    checked = run_cell(cell)
    assert checked >= 2, f"only {checked} steps checked"
    return f"{checked} steps checked"


def _device():
    return torch.device("cpu") if ON_CPU else torch.device("cuda", 0)


def skip_reason():
    if ON_CPU:
        return None
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    return None


def _init():
    import deepspeed
    import deepspeed.comm as dist
    if dist.is_initialized():
        return
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    if ON_CPU:
        os.environ["DS_ACCELERATOR"] = "cpu"
    else:
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="gloo" if ON_CPU else "nccl", verbose=False)


PATH_ENTRIES = [("paths-" + n, check_paths, n) for n in sorted(PATH_CASES)]
OVERLAP_ENTRIES = [("overlap-" + n, check_overlap, n) for n in OVERLAP_CASES]
ORDERING_ENTRIES = [("transfers-ordering", check_transfer_ordering, None)]
ALL = PATH_ENTRIES + OVERLAP_ENTRIES + ORDERING_ENTRIES + [(c["id"], check_contract, c["id"]) for c in CONTRACT_CELLS]


@pytest.mark.parametrize("case_id", [c[0] for c in ALL])
def test_offload_paths(case_id):
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    _init()
    _, fn, arg = next(c for c in ALL if c[0] == case_id)
    fn(arg)


def main(argv):
    reason = skip_reason()
    if reason is not None:
        print(f"skipped: {reason}")
        print("0 passed, 0 failed")
        return 0
    _init()
    failed, passed = [], 0
    start = time.perf_counter()
    for case_id, fn, arg in ALL:
        if argv and not any(s in case_id for s in argv):
            continue
        t0 = time.perf_counter()
        try:
            message = fn(arg)
        except Exception:
            failed.append(case_id)
            print(f"FAIL {case_id}\n{traceback.format_exc()}", flush=True)
            continue
        passed += 1
        print(f"PASS {case_id}: {message} ({time.perf_counter() - t0:.1f}s)", flush=True)
    print(f"{passed} passed, {len(failed)} failed ({time.perf_counter() - start:.0f}s, "
          f"{'gloo/CPU' if ON_CPU else 'NCCL/CUDA'})")
    if failed:
        print("failed: " + " ".join(failed))
    return 1 if failed else 0


# Speculative steps (offload_optimizer.super_offload) against the exact pipelined step: same bits after every step.
Z3_BOTH_PINNED = dict(SMALL_UNITS, offload_optimizer=PIN, offload_param=PIN)
Z3_OPTIMIZER_PINNED = dict(SMALL_UNITS, offload_optimizer=PIN)
Z3_PARAM_RING = dict(SMALL_UNITS, offload_optimizer=PIN, offload_param=dict(PAGEABLE, buffer_count=2, buffer_size=700))
SPECULATIVE_CASES = {
    "z2-gas2-noclip": dict(stage=2, gas=2, clip=1e6, zero={"offload_optimizer": PIN}),
    "z2-gas1-clip1": dict(stage=2, gas=1, clip=1.0, zero={"offload_optimizer": PIN}),
    "z1-gas2-fp16-noclip": dict(stage=1, gas=2, clip=1e6, dtype="fp16", zero={"offload_optimizer": PIN}),
    "z2-gas2-pageable-noclip": dict(stage=2, gas=2, clip=1e6, zero={"offload_optimizer": PAGEABLE}),
    "z3-both-pinned-gas2-noclip": dict(stage=3, gas=2, clip=1e6, zero=Z3_BOTH_PINNED),
    "z3-optimizer-only-gas1-clip1": dict(stage=3, gas=1, clip=1.0, zero=Z3_OPTIMIZER_PINNED),
    "z3-param-ring-gas1-noclip": dict(stage=3, gas=1, clip=1e6, zero=Z3_PARAM_RING),
}


def _train_speculative(case, device, super_offload, steps=5):
    import deepspeed
    cfg = _config(case)
    cfg["gradient_clipping"] = case["clip"]
    cfg["zero_optimization"]["offload_optimizer"] = dict(cfg["zero_optimization"]["offload_optimizer"],
                                                         super_offload=super_offload)
    torch.manual_seed(0)
    model = _Model()
    history = []
    with _environment({"DS_OFFLOAD_OVERLAP": "1", "DS_OFFLOAD_SYNC": "0"}):
        engine = deepspeed.initialize(model=copy.deepcopy(model), config=cfg)[0]
        try:
            for step in range(steps):
                for micro in range(case["gas"]):
                    gen = torch.Generator().manual_seed(100 * step + micro)
                    tokens = torch.randint(0, 64, (4, 16), generator=gen).to(device)
                    loss = F.cross_entropy(engine(tokens).float().reshape(-1, 64), tokens.roll(1, 1).reshape(-1))
                    engine.backward(loss)
                    engine.step()
                stage = engine._stage
                if case["stage"] == 3:  # the whole 16-bit parameters (completes a step still running)
                    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                        entry = [p.detach().float().cpu().clone() for p in engine.module.parameters()]
                else:
                    entry = [v.detach().float().cpu().clone() for v in engine.module.state_dict().values()]
                stage._masters_current()
                entry += [m.detach().cpu().clone() for m in stage.masters]
                for master in stage.masters:
                    state = stage.optimizer.state.get(master, {})
                    entry += [state[k].detach().cpu().clone() for k in ("exp_avg", "exp_avg_sq") if k in state]
                history.append(entry)
            stats = engine.optimizer.speculative_stats
        finally:
            engine.destroy()
    return history, stats


def check_speculative(name):
    """super_offload (speculative steps, rolled back when the step clips) against the exact pipelined step."""
    from deepspeed.runtime.zero.offload.step_pipeline import StepPipeline
    case = SPECULATIVE_CASES[name]
    device = _device()
    exact, none = _train_speculative(case, device, False)
    assert none is None
    StepPipeline.piece_delay = 0.002
    try:
        tested, stats = _train_speculative(case, device, True)
    finally:
        StepPipeline.piece_delay = 0.0
    for step, (a, b) in enumerate(zip(tested, exact)):
        assert len(a) == len(b), f"{name}: step {step}: {len(a)} tensors against {len(b)}"
        for index, (x, y) in enumerate(zip(a, b)):
            if not torch.equal(x, y):
                diff = (x.float() - y.float()).abs().max().item()
                raise AssertionError(f"{name}: step {step} tensor {index} differs from the exact step "
                                     f"(max abs diff {diff:g}); {stats}")
    assert stats["boundary_steps"] == len(exact), stats
    if case["clip"] > 1e3:  # nothing can clip: every step speculated and kept
        assert stats["kept"] == len(exact) and stats["rolled_back"] == 0 and stats["pieces_early"] > 0, stats
    assert any(not torch.equal(x, y) for x, y in zip(exact[0], exact[-1])), f"{name}: nothing trained"
    return (f"{len(tested)} steps identical; kept {stats['kept']}, rolled back {stats['rolled_back']} "
            f"{ {k: v for k, v in stats['reasons'].items() if v} }, not speculated {stats['not_speculated']}, "
            f"pieces early {stats['pieces_early']}")


SPECULATIVE_ENTRIES = [("speculative-" + n, check_speculative, n) for n in SPECULATIVE_CASES]
ALL += SPECULATIVE_ENTRIES


@pytest.mark.parametrize("case_id", [c[0] for c in SPECULATIVE_ENTRIES])
def test_speculative_offload(case_id):
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    _init()
    _, fn, arg = next(c for c in ALL if c[0] == case_id)
    fn(arg)


# ---------------------------------------------------------------- ZeRO-3: the step overlapping the next forward
Z3_OVERLAP_CASES = {
    "z3ov-both-pinned-gas2": (dict(stage=3, gas=2, zero=dict(SMALL_UNITS, offload_optimizer=PIN,
                                                             offload_param=PIN)), None),
    "z3ov-param-ring-gas1": (dict(stage=3,
                                  gas=1,
                                  zero=dict(SMALL_UNITS,
                                            offload_optimizer=PIN,
                                            offload_param=dict(PAGEABLE, buffer_count=2, buffer_size=700))), None),
    "z3ov-optimizer-only-gas2": (dict(stage=3, gas=2, zero=dict(SMALL_UNITS, offload_optimizer=PIN)), None),
    "z3ov-ratio0.5-both-gas1": (dict(stage=3, gas=1, zero=dict(SMALL_UNITS, offload_optimizer=PIN,
                                                               offload_param=PIN)), 0.5),
    "z3ov-ratio0.5-optimizer-only-gas2": (dict(stage=3, gas=2, zero=dict(SMALL_UNITS, offload_optimizer=PIN)), 0.5),
}


def _train_z3_overlap(case, device, env, steps=5):
    """Losses of every micro-step and of an eval forward right after each step (both run while the step may still
    be stepping its last pieces), then the 16-bit parameters, masters and moments; and how many steps returned
    before their host step was done."""
    import deepspeed
    torch.manual_seed(0)
    model = _Model()
    losses, overlapped = [], 0
    probe = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(5)).to(device)
    with _environment(dict(env, DS_OFFLOAD_SYNC="0")):
        engine = deepspeed.initialize(model=copy.deepcopy(model), config=_config(case))[0]
        try:
            stage = engine._stage
            for step in range(steps):
                for micro in range(case["gas"]):
                    gen = torch.Generator().manual_seed(100 * step + micro)
                    tokens = torch.randint(0, 64, (4, 16), generator=gen).to(device)
                    loss = F.cross_entropy(engine(tokens).float().reshape(-1, 64), tokens.roll(1, 1).reshape(-1))
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
                pipeline = stage.host_step.pipeline
                overlapped += int(pipeline is not None and pipeline.pending)
                with torch.no_grad():
                    losses.append(engine(probe).float().sum().item())
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                state = [p.detach().cpu().clone() for p in engine.module.parameters()]
            stage._masters_current()
            state += [m.detach().cpu().clone() for m in stage.masters]
            for master in stage.masters:
                entry = stage.optimizer.state.get(master, {})
                state += [entry[k].detach().cpu().clone() for k in ("exp_avg", "exp_avg_sq") if k in entry]
        finally:
            engine.destroy()
    return losses, state, overlapped


def check_z3_overlap(name):
    """ZeRO-3: the step overlapping the next forward (each piece slowed by 5 ms) against the whole-partition step."""
    from deepspeed.runtime.zero.offload.step_pipeline import StepPipeline
    case, ratio = Z3_OVERLAP_CASES[name]
    device = _device()
    ref_losses, ref_state, _ = _train_z3_overlap(case, device, {"DS_OFFLOAD_OVERLAP": "0"})
    if ratio is not None:
        case = copy.deepcopy(case)
        case["zero"]["offload_optimizer"] = dict(case["zero"]["offload_optimizer"], ratio=ratio)
    StepPipeline.piece_delay = 0.005
    try:
        losses, state, overlapped = _train_z3_overlap(case, device, {"DS_OFFLOAD_OVERLAP": "1"})
    finally:
        StepPipeline.piece_delay = 0.0
    assert overlapped > 0, f"{name}: engine.step() never returned before its host step was done"
    assert losses == ref_losses, f"{name}: losses differ: {losses} vs {ref_losses}"
    assert len(state) == len(ref_state)
    for index, (x, y) in enumerate(zip(state, ref_state)):
        if not torch.equal(x, y):
            diff = (x.float() - y.float()).abs().max().item()
            raise AssertionError(
                f"{name}: tensor {index} differs from the whole-partition step (max abs diff {diff:g})")
    return f"{len(losses)} losses and {len(state)} tensors identical, {overlapped} steps overlapped"


Z3_OVERLAP_ENTRIES = [(n, check_z3_overlap, n) for n in Z3_OVERLAP_CASES]


@pytest.mark.parametrize("case_id", [c[0] for c in Z3_OVERLAP_ENTRIES])
def test_z3_overlap_step(case_id):
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    _init()
    _, fn, arg = next(c for c in ALL if c[0] == case_id)
    fn(arg)


ALL += Z3_OVERLAP_ENTRIES


# ------------------------------------------ reads of parameters between engine.step() and the next forward
def _reads_after_step(overlap, device, steps=4):
    """ZeRO-2 offload on one GPU; after each step the parameters read through the module (as an EMA does)."""
    import deepspeed
    from deepspeed.runtime.zero.offload.step_pipeline import StepPipeline
    cfg = _config(dict(stage=2, gas=1, zero={"offload_optimizer": PIN}))
    torch.manual_seed(0)
    model = _Model()
    reads = []
    StepPipeline.piece_delay = 0.002 if overlap else 0.0
    try:
        with _environment({"DS_OFFLOAD_OVERLAP": "1" if overlap else "0", "DS_OFFLOAD_SYNC": "0"}):
            engine = deepspeed.initialize(model=copy.deepcopy(model), config=cfg)[0]
            try:
                for step in range(steps):
                    gen = torch.Generator().manual_seed(100 * step)
                    tokens = torch.randint(0, 64, (4, 16), generator=gen).to(device)
                    loss = F.cross_entropy(engine(tokens).float().reshape(-1, 64), tokens.roll(1, 1).reshape(-1))
                    engine.backward(loss)
                    engine.step()
                    pending = engine._stage.host_step.pipeline.pending if overlap else False
                    # on the compute stream, right after step(): the reads must see the stepped values
                    reads.append(([p.detach().float().cpu() for p in engine.module.parameters()], pending))
            finally:
                engine.destroy()
    finally:
        StepPipeline.piece_delay = 0.0
    return reads


def check_reads(_name):
    """Parameters read through the module while the pipelined step still runs equal the whole-partition step's."""
    device = _device()
    want = _reads_after_step(False, device)
    got = _reads_after_step(True, device)
    pending = 0
    for step, ((a, was_pending), (b, _)) in enumerate(zip(got, want)):
        pending += was_pending
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"step {step}: a read after step() differs from the whole-partition step"
    assert pending > 0, "no step was still running when the parameters were read"
    return f"{len(got)} steps identical, {pending} read while the step ran"


READS_ENTRIES = [("reads-z2-after-step", check_reads, "reads")]


@pytest.mark.parametrize("case_id", [c[0] for c in READS_ENTRIES])
def test_reads_after_step(case_id):
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    _init()
    _, fn, arg = next(c for c in ALL if c[0] == case_id)
    fn(arg)


ALL += READS_ENTRIES

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
