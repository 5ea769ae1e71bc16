# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3's offloaded step overlapping the next forward, against the whole-partition step: the same bits.

With the pipelined host step, ``engine.step()`` on ZeRO-3 returns while the host worker steps the units'
pieces in the next forward's gather order, and each unit's gather waits only for the pieces covering its
shards (``deepspeed/runtime/zero/offload/unit_step.py``). The reference is ``DS_OFFLOAD_OVERLAP=0``: the whole
partition stepped by ``DeepSpeedCPUAdam``, clipping in a pass of its own, the 16-bit shards written (or
uploaded) before ``step()`` returns. Every piece is slowed on purpose (``StepPipeline.piece_delay``), so a
gather that did not wait for its pieces would read stale shards and the losses would differ.
"""

import os
import tempfile

import pytest
import torch

import deepspeed
from deepspeed.ops.adam import host_adam
from deepspeed.runtime.zero.gradients import grad_ops
from deepspeed.runtime.zero.offload.step_pipeline import StepPipeline
from tests.unit.common import run_distributed

pytestmark = pytest.mark.skipif(host_adam.host_adam_op() is None, reason="the host Adam op cannot be built here")


class _Net(torch.nn.Module):

    def __init__(self, width, depth):
        super().__init__()
        self.embed = torch.nn.Linear(7, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _config(gas, offload_param, ratio=1.0):
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 12,  # the biases: a persistent unit, re-gathered inside step()
        "stage3_prefetch_bucket_size": 60,  # one unit per block
        "offload_optimizer": {
            "device": "cpu",
            "ratio": ratio
        },
    }
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "bf16": {
            "enabled": True
        },
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 3e-2,
                "weight_decay": 0.1
            }
        },
        "zero_optimization": zero,
    }


class _Overlap:
    """``DS_OFFLOAD_OVERLAP`` and the piece delay for one run."""

    def __init__(self, overlap, delay):
        self.overlap, self.delay = overlap, delay

    def __enter__(self):
        os.environ["DS_OFFLOAD_OVERLAP"] = "1" if self.overlap else "0"
        StepPipeline.piece_delay = self.delay if self.overlap else 0.0
        return self

    def __exit__(self, *exc):
        StepPipeline.piece_delay = 0.0
        os.environ.pop("DS_OFFLOAD_OVERLAP", None)
        return False


def _engine(gas, offload_param, seed=7, width=9, depth=3, ratio=1.0, groups=False):
    torch.manual_seed(seed)
    model = _Net(width, depth)
    params = model.parameters()
    if groups:  # two param groups: the persistent unit (the biases) has a segment in each
        second = ("blocks.1.", "head.")
        params = [{
            "params": [p for n, p in model.named_parameters() if not n.startswith(second)]
        }, {
            "params": [p for n, p in model.named_parameters() if n.startswith(second)],
            "weight_decay": 0.0,
            "lr": 1e-2
        }]
    engine = deepspeed.initialize(model=model, model_parameters=params, config=_config(gas, offload_param, ratio))[0]
    return engine, model


def _state(engine, model):
    """The 16-bit parameters, fp32 masters and Adam moments (and step counts) after the run."""
    stage = engine._stage
    with deepspeed.zero.GatheredParameters(list(model.parameters())):  # completes a step still running
        params = [p.detach().clone() for p in model.parameters()]
    stage._masters_current()
    masters = [m.detach().clone() for m in stage.masters]
    moments = []
    for master in stage.masters:
        entry = stage.optimizer.state.get(master, {})
        moments += [entry[k].clone() for k in ("exp_avg", "exp_avg_sq") if k in entry]
        if "step" in entry:
            moments.append(torch.as_tensor(float(entry["step"])))
    return params, masters, moments


def _train(overlap, gas, offload_param, steps, delay, extras=(), ratio=1.0):
    """Losses (train and eval), then the state of :func:`_state`; ``extras`` name what runs between steps."""
    with _Overlap(overlap, delay):
        engine, model = _engine(gas, offload_param, ratio=ratio, groups="groups" in extras)
        stage = engine._stage
        assert (stage.unit_step is not None) == overlap
        if "groups" in extras:
            persistent = next(u for u in stage.units if u.persistent)
            assert [g for g, *_ in stage.layout.segments[persistent.index]] == [0, 1]
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        gen = torch.Generator().manual_seed(100 + rank)
        probe = torch.randn(2, 7, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        losses, evals, pending = [], [], 0
        for micro in range(steps * gas):
            x = torch.randn(2, 7, generator=gen).to(torch.bfloat16)
            y = torch.randn(2, 3, generator=gen)
            loss = torch.nn.functional.mse_loss(engine(x).float(), y) * 50.0  # large gradients: clipping is active
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if (micro + 1) % gas:
                continue
            pending += int(overlap and stage.host_step.pipeline.pending)
            if "eval" in extras:  # a forward under no_grad right after the step: its gathers wait too
                engine.eval()
                with torch.no_grad():
                    evals.append(engine(probe).float().tolist())
                engine.train()
            if "zero_grad" in extras:
                engine.zero_grad()
            if "peek" in extras:
                from deepspeed.utils import safe_get_full_fp32_param
                evals.append(safe_get_full_fp32_param(model.blocks[1].weight).sum().item())
        if overlap:
            assert pending == steps, "engine.step() waited for the whole host step"
        out = (losses, evals) + _state(engine, model)
        engine.destroy()
        return out


def _assert_same(a, b):
    assert a[0] == b[0], f"losses differ: {a[0]} vs {b[0]}"
    assert a[1] == b[1], f"eval outputs or accessor values differ: {a[1]} vs {b[1]}"
    for name, x_list, y_list in zip(("16-bit params", "masters", "moments"), a[2:], b[2:]):
        assert len(x_list) == len(y_list) and x_list, name
        for x, y in zip(x_list, y_list):
            assert torch.equal(x, y), f"{name} differ"
    assert a[0][0] != a[0][-1]  # it trained


def _compare(gas, offload_param, steps, delay, extras=(), ratio=1.0):
    exact = _train(False, gas, offload_param, steps, 0.0, extras)
    overlapped = _train(True, gas, offload_param, steps, delay, extras, ratio=ratio)
    _assert_same(exact, overlapped)
    return True


@pytest.mark.parametrize("gas,offload_param", [(1, True), (2, True), (1, False), (2, False)])
def test_overlapped_step_is_bit_identical_world1(gas, offload_param):
    assert run_distributed(_compare, 1, args=(gas, offload_param, 3, 0.01), timeout=300) == [True]


@pytest.mark.parametrize("offload_param", [True, False])
def test_overlapped_step_is_bit_identical_world2(offload_param):
    assert run_distributed(_compare, 2, args=(2, offload_param, 3, 0.005), timeout=300) == [True, True]


@pytest.mark.parametrize("offload_param", [True, False])
def test_eval_forward_zero_grad_and_accessors_after_the_step(offload_param):
    args = (1, offload_param, 3, 0.01, ("eval", "zero_grad", "peek"))
    assert run_distributed(_compare, 1, args=args, timeout=300) == [True]


@pytest.mark.parametrize("offload_param", [True, False])
def test_two_param_groups(offload_param):
    assert run_distributed(_compare, 1, args=(2, offload_param, 3, 0.01, ("groups", )), timeout=300) == [True]


@pytest.mark.parametrize("offload_param", [True, False])
def test_partial_offload_overlapped_equals_full_offload_exact(offload_param):
    # offload_optimizer.ratio: the device share's pieces (the first units) wait for its copy into the targets
    assert run_distributed(_compare, 2, args=(2, offload_param, 3, 0.005, ("eval", "peek"), 0.5),
                           timeout=300) == [True, True]


# ------------------------------------------------------------------ a gather waits for its pieces
def _gather_waits(offload_param):
    """Every read of a unit's shards comes after the worker stepped every piece covering them; and at least one
    gather found its pieces not yet stepped (it really waited)."""
    stepped = []  # (group, start, length), appended by the worker after each piece
    original_step_piece = host_adam.step_piece

    def logged_step_piece(op, group, scalars, param, grad, state, start, length, *args, **kwargs):
        result = original_step_piece(op, group, scalars, param, grad, state, start, length, *args, **kwargs)
        stepped.append((param.data_ptr(), start, length))
        return result

    host_adam.step_piece = logged_step_piece
    try:
        with _Overlap(True, 0.02):
            engine, model = _engine(1, offload_param, depth=4)
            stage = engine._stage
            masters = [m.data.data_ptr() for m in stage.masters]

            def covered(unit):
                done = {}
                for ptr, start, length in list(stepped):
                    done.setdefault(ptr, []).append((start, start + length))
                for g, offset, _, length in stage.layout.segments[unit.index]:
                    if g >= len(masters) or not length:
                        continue
                    at, end = offset, offset + length
                    for lo, hi in sorted(done.get(masters[g], [])):
                        if lo <= at < hi:
                            at = hi
                    if at < end:
                        return False
                return True

            record = {"reads": 0, "early": 0, "stale": 0, "unit": None}
            send_chunk = stage.coordinator._send_chunk

            def instrumented_send_chunk(unit, out):
                if stage.host_step.pipeline.pending and not covered(unit):
                    record["early"] += 1  # the gather starts before its pieces are stepped: it must wait
                record["unit"] = unit
                try:
                    return send_chunk(unit, out)
                finally:
                    record["unit"] = None

            def on_read(read):

                def reading(*args, **kwargs):
                    unit = record["unit"]
                    if unit is not None and stage.host_step.pipeline.pending:
                        record["reads"] += 1
                        record["stale"] += int(not covered(unit))
                    return read(*args, **kwargs)

                return reading

            stage.coordinator._send_chunk = instrumented_send_chunk
            if offload_param:
                stage.fetch.fetch = on_read(stage.fetch.fetch)
            else:
                original_pack = grad_ops.pack_cast
                grad_ops.pack_cast = on_read(original_pack)
            try:
                gen = torch.Generator().manual_seed(1)
                for _ in range(3):
                    x = torch.randn(2, 7, generator=gen).to(torch.bfloat16)
                    loss = engine(x).float().square().mean()
                    engine.backward(loss)
                    engine.step()
            finally:
                if not offload_param:
                    grad_ops.pack_cast = original_pack
            engine.destroy()
    finally:
        host_adam.step_piece = original_step_piece
    assert record["stale"] == 0, f"{record['stale']} gathers read shards whose pieces were not stepped"
    assert record["early"] > 0 and record["reads"] > 0, f"no gather overlapped the step: {record}"
    return True


@pytest.mark.parametrize("offload_param", [True, False])
def test_a_gather_waits_for_its_pieces(offload_param):
    assert run_distributed(_gather_waits, 1, args=(offload_param, ), timeout=300) == [True]


# --------------------------------------------------- what reads the step's state right after step()
def _load_all(directory):
    out = {}
    for root, _, files in os.walk(directory):
        for name in sorted(files):
            if name.endswith(".pt"):
                path = os.path.join(root, name)
                out[os.path.relpath(path, directory)] = torch.load(path, map_location="cpu", weights_only=False)
    return out


def _same_tree(a, b, where="checkpoint"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for key in a:
            if key != "save_id":  # a random id each save writes (the files of one save agree on it)
                _same_tree(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            _same_tree(x, y, f"{where}[{i}]")
    elif isinstance(a, (int, float, str, bool, type(None))):
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _right_after_step(overlap, offload_param, directory):
    """Train two steps and save a checkpoint right after the second ``step()``; overlapped, one more step and
    ``state_dict()`` right after it (its pre-hook completes the step)."""
    with _Overlap(overlap, 0.02):
        engine, model = _engine(1, offload_param)
        gen = torch.Generator().manual_seed(3)
        for _ in range(2):
            x = torch.randn(2, 7, generator=gen).to(torch.bfloat16)
            engine.backward(engine(x).float().square().mean() * 10.0)
            engine.step()
        pipeline = engine._stage.host_step.pipeline
        if overlap:
            assert pipeline.pending
        engine.save_checkpoint(directory, tag="t")
        saved = _load_all(directory)
        if overlap:
            engine.backward(engine(torch.ones(2, 7, dtype=torch.bfloat16)).float().sum())
            engine.step()
            assert pipeline.pending
            model.state_dict()  # its pre-hook completes the step
            assert not pipeline.pending
        engine.destroy()
        return saved


def _checkpoint_equal(offload_param):
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        exact = _right_after_step(False, offload_param, a)
        overlapped = _right_after_step(True, offload_param, b)
    assert set(exact) == set(overlapped) and exact
    for name in exact:
        _same_tree(exact[name], overlapped[name], name)
    return True


@pytest.mark.parametrize("offload_param", [True, False])
def test_checkpoint_saved_right_after_step_equals_the_exact_one(offload_param):
    assert run_distributed(_checkpoint_equal, 1, args=(offload_param, ), timeout=300) == [True]


def _read_right_after_step(offload_param, reader):
    """Right after ``step()``, the whole 16-bit values through ``GatheredParameters`` (it reads ``ds_tensor``) or
    the consolidated state dict (what ``save_16bit_model`` writes): the exact path's values."""
    results = []
    for overlap in (False, True):
        with _Overlap(overlap, 0.02):
            engine, model = _engine(2, offload_param)
            gen = torch.Generator().manual_seed(4)
            for _ in range(2 * 2):
                x = torch.randn(2, 7, generator=gen).to(torch.bfloat16)
                engine.backward(engine(x).float().square().mean() * 10.0)
                engine.step()
            assert engine._stage.host_step.pipeline is None or engine._stage.host_step.pipeline.pending
            if reader == "gathered":
                with deepspeed.zero.GatheredParameters(list(model.parameters())):
                    results.append([p.detach().clone() for p in model.parameters()])
            else:
                results.append(list(engine._zero3_consolidated_16bit_state_dict().values()))
            engine.destroy()
    assert len(results[0]) == len(results[1]) and results[0]
    for x, y in zip(*results):
        assert torch.equal(x, y)
    return True


@pytest.mark.parametrize("offload_param", [True, False])
@pytest.mark.parametrize("reader", ["gathered", "consolidated"])
def test_whole_values_read_right_after_step(offload_param, reader):
    assert run_distributed(_read_right_after_step, 1, args=(offload_param, reader), timeout=300) == [True]


def _two_engines(offload_param):
    """Two engines in one process, their steps interleaved: each overlapped step equals its exact one."""
    runs = []
    for overlap in (False, True):
        with _Overlap(overlap, 0.01):
            first, model_a = _engine(1, offload_param, seed=1)
            second, model_b = _engine(2, offload_param, seed=2, width=6)
            gen = torch.Generator().manual_seed(9)
            losses = []
            for _ in range(3):
                for engine, gas in ((first, 1), (second, 2)):
                    for _ in range(gas):
                        x = torch.randn(2, 7, generator=gen).to(torch.bfloat16)
                        loss = engine(x).float().square().mean() * 10.0
                        engine.backward(loss)
                        engine.step()
                        losses.append(loss.item())
            runs.append((losses, _state(first, model_a), _state(second, model_b)))
            first.destroy()
            second.destroy()
    (la, sa1, sb1), (lb, sa2, sb2) = runs
    assert la == lb
    for s1, s2 in ((sa1, sa2), (sb1, sb2)):
        for x_list, y_list in zip(s1, s2):
            for x, y in zip(x_list, y_list):
                assert torch.equal(x, y)
    return True


def test_two_engines_interleaved():
    assert run_distributed(_two_engines, 1, args=(True, ), timeout=300) == [True]


# ------------------------------------------------------------------ a forward in another order
class _Dynamic(_Net):
    """A dynamic graph: by ``mode``, every block in order (0), the last block skipped (1), the blocks reversed (2)."""

    mode = 0

    def forward(self, x):
        x = self.embed(x)
        blocks = list(self.blocks)
        if self.mode == 1:
            blocks = blocks[:-1]
        elif self.mode == 2:
            blocks = blocks[::-1]
        for block in blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _train_dynamic(overlap, offload_param, modes, delay):
    with _Overlap(overlap, delay):
        torch.manual_seed(11)
        model = _Dynamic(9, 3)
        engine = deepspeed.initialize(model=model,
                                      model_parameters=model.parameters(),
                                      config=_config(1, offload_param))[0]
        gen = torch.Generator().manual_seed(12)
        losses = []
        for mode in modes:
            model.mode = mode
            x = torch.randn(2, 7, generator=gen).to(torch.bfloat16)
            loss = engine(x).float().square().mean() * 50.0
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out = (losses, []) + _state(engine, model)
        engine.destroy()
        return out


def _compare_dynamic(offload_param, modes, delay):
    _assert_same(_train_dynamic(False, offload_param, modes, 0.0), _train_dynamic(True, offload_param, modes, delay))
    return True


@pytest.mark.parametrize("offload_param", [True, False])
def test_forward_order_other_than_the_recorded_one(offload_param):
    # the first forward skips the last block, so its unit's pieces are stepped last (after the traced units); a
    # step after a forward that used it is still stepping them while the next forward, skipping it again, and
    # its backward run (no gather waits for them: the folds into the gradient partitions must); the reversed
    # forwards gather in another order than the recorded one (each gather waits for its own pieces)
    modes = (1, 0, 1, 0, 1, 2, 0, 2)
    assert run_distributed(_compare_dynamic, 1, args=(offload_param, modes, 0.05), timeout=300) == [True]
