# SPDX-License-Identifier: Apache-2.0
"""Pipeline checkpoints in upstream's layout: saved at 2 stages x 2 data-parallel ranks (ZeRO-1, Adam, a weight tied
across the stages), loaded at 4 stages (ZeRO-2), at 1 stage x 4 (ZeRO-0) and, through ``ds_to_universal``, at 4
stages (ZeRO-1) with the same parameters, the same next loss and the same step after it; upstream DeepSpeed
0.19.8's own pipeline checkpoints load here and continue as upstream did
(``tests/unit/checkpoint/upstream/write_pipe_fixtures.py``)."""

import os
import shutil

import pytest
import torch

from tests.unit.common import run_distributed

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "..", "checkpoint", "upstream", "fixtures_pipe")


def _fixture_model():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "write_pipe_fixtures", os.path.join(HERE, "..", "..", "checkpoint", "upstream", "write_pipe_fixtures.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _layer_params(engine):
    """Every layer's parameters, gathered on every rank: ``{layer index: {name: value}}`` (the tie under its first
    layer)."""
    import deepspeed.comm as dist
    mine = {}
    if engine.grid.get_data_parallel_rank() == 0:
        for name, p in engine.module.named_parameters():
            if name.startswith("tied_modules."):
                index, attr = 0, name.split(".", 2)[2]
            else:
                index, attr = int(name.split(".")[0]), name.split(".", 1)[1]
            mine.setdefault(index, {})[attr] = p.detach().float().clone()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged = {}
    for part in everyone:
        for index, params in part.items():
            merged.setdefault(index, {}).update(params)
    return merged


def _max_diff(a, b):
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float((a[i][k] - b[i][k]).abs().max()) for i in a for k in a[i])


def _engine(fixture, stages, gas, zero, dtype="fp32", **extra):
    import deepspeed
    from deepspeed.pipe import PipelineModule
    model = PipelineModule(fixture.layers(), num_stages=stages, loss_fn=fixture.loss_fn, partition_method="uniform")
    cfg = fixture.ds_config(f"pp2-z{zero}-{dtype}")
    cfg["gradient_accumulation_steps"] = gas
    cfg.update(extra)
    return deepspeed.initialize(model=model, config=cfg)[0]


def _global_batch(fixture, step, micro_batches):
    gen = torch.Generator().manual_seed(7 + step)
    shape = (fixture.MICRO, fixture.SEQ)
    return [(torch.randint(0, fixture.VOCAB, shape,
                           generator=gen), torch.randint(0, fixture.VOCAB, shape, generator=gen))
            for _ in range(micro_batches)]


def _mine(engine, batch):
    gas, rank = engine.micro_batches, engine.grid.get_data_parallel_rank()
    return iter(batch[rank * gas:(rank + 1) * gas])


def _reshard(tmp):
    fixture = _fixture_model()
    engine = _engine(fixture, stages=2, gas=2, zero=1)
    for step in range(2):
        engine.train_batch(_mine(engine, _global_batch(fixture, step, 4)))
    engine.save_checkpoint(tmp, tag="s", client_state={"epoch": 5})
    saved = _layer_params(engine)
    nxt = _global_batch(fixture, 2, 4)
    expected_loss = float(engine.train_batch(_mine(engine, nxt)))
    expected_after = _layer_params(engine)
    files = sorted(os.listdir(os.path.join(tmp, "s")))
    engine.destroy()
    import deepspeed.comm as dist
    if dist.get_rank() == 0:  # ds_to_universal of the pipeline checkpoint
        from deepspeed.checkpoint.ds_to_universal import convert
        convert(os.path.join(tmp, "s"), os.path.join(tmp, "s_universal"))
    dist.barrier()
    out = {"files": files}
    universal = {"checkpoint": {"load_universal": True}}
    for name, stages, gas, zero, tag, extra in [("pp4-z2", 4, 4, 2, "s", {}), ("pp1xdp4-z0", 1, 1, 0, "s", {}),
                                                ("universal-pp4-z1", 4, 4, 1, "s_universal", universal)]:
        engine = _engine(fixture, stages=stages, gas=gas, zero=zero, **extra)
        path, client = engine.load_checkpoint(tmp, tag=tag)
        loaded = _max_diff(_layer_params(engine), saved)
        loss = float(engine.train_batch(_mine(engine, nxt)))
        after = _max_diff(_layer_params(engine), expected_after)
        out[name] = (loaded, abs(loss - expected_loss), after, client.get("epoch"), engine.global_steps)
        engine.destroy()
    return out


def test_saved_at_two_stages_loads_at_one_and_four(tmp_path):
    tmp = str(tmp_path)
    results = run_distributed(_reshard, 4, args=(tmp, ), timeout=240)
    files = results[0]["files"]
    assert [f for f in files if f.startswith("layer_")] == [f"layer_0{i}-model_states.pt" for i in range(5)]
    assert "mp_rank_00_model_states.pt" in files and "mp_rank_01_model_states.pt" in files
    assert {f"zero_pp_rank_{r}_mp_rank_0{s}_optim_states.pt" for r in (0, 1) for s in (0, 1)} <= set(files)
    for result in results:
        for name in ("pp4-z2", "pp1xdp4-z0", "universal-pp4-z1"):
            loaded, loss, after, epoch, steps = result[name]
            assert loaded == 0.0 and loss < 1e-6 and after < 1e-6, (name, result[name])
            assert epoch == 5 and steps == 3


def _upstream(cell, tmp, stages, gas):
    fixture = _fixture_model()
    record = torch.load(os.path.join(tmp, cell, "trajectory.pt"), weights_only=False)
    engine = _engine(fixture, stages=stages, gas=gas, zero=int(cell.split("-")[1][1:]), dtype=cell.split("-")[2])
    path, client = engine.load_checkpoint(os.path.join(tmp, cell), tag=fixture.TAG)
    loaded = _max_diff(_layer_params(engine), record["at_save"])
    loss = float(engine.train_batch(_mine(engine, fixture.batches(2))))
    after = _max_diff(_layer_params(engine), record["after"])
    engine.destroy()
    return loaded, abs(loss - record["next_loss"]), after, client.get("epoch")


@pytest.mark.parametrize("cell,world,stages,gas", [("pp2-z0-fp32", 2, 2, 2), ("pp2-z1-fp32", 2, 2, 2),
                                                   ("pp2-z1-bf16", 2, 2, 2), ("pp2-z1-fp32", 2, 1, 1)])
def test_upstream_pipeline_checkpoints_continue_as_upstream(cell, world, stages, gas, tmp_path):
    shutil.copytree(os.path.join(FIXTURES, cell), os.path.join(str(tmp_path), cell))
    results = run_distributed(_upstream, world, args=(cell, str(tmp_path), stages, gas), timeout=180)
    tolerance = 1e-6 if cell.endswith("fp32") else 1e-2
    for loaded, loss, after, epoch in results:
        assert loaded < tolerance and loss < tolerance and after < tolerance, results
        assert epoch == 3


def _checkpoint_while_offloaded(case, save_dir):
    """A pipeline engine's save_checkpoint and load_checkpoint after offload_states(): refused by name, as the
    base engine's are; after reload_states() the save runs."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from tests.unit.runtime.pipe.pipe_cases import batches, build_layers, config_of, loss_fn_of
    from deepspeed.runtime.engine_parts.usage_errors import EngineUsageError
    model = PipelineModule(build_layers(case), num_stages=case["stages"], loss_fn=loss_fn_of(case))
    engine, *_ = deepspeed.initialize(model=model, config=config_of(case))
    data = iter(batches(case, 8))
    engine.train_batch(iter([next(data) for _ in range(case["gas"])]))
    engine.offload_states()
    refused = []
    for call in (lambda: engine.save_checkpoint(save_dir), lambda: engine.load_checkpoint(save_dir)):
        try:
            call()
        except EngineUsageError as exc:
            refused.append("reload_states" in str(exc))
    engine.reload_states()
    engine.save_checkpoint(save_dir)
    engine.destroy()
    return refused


def test_checkpoint_refused_while_states_are_offloaded(tmp_path):
    case = dict(world=2, stages=2, gas=2, widths=[16, 8, 8, 8, 4], zero=1, optimizer="adam")
    for refused in run_distributed(_checkpoint_while_offloaded, 2, args=(case, str(tmp_path)), timeout=120):
        assert refused == [True, True]
