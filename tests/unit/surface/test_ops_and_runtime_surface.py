# SPDX-License-Identifier: Apache-2.0
"""Optimizers and runtime modules of upstream's surface against plain-torch references: the fused_adam op,
ZenFlowSelectiveAdamW, DeepSpeedCPUAdam.step_subgroup, coalesced reduce-scatter, SparseTensor, checkpoint
engines, DeepSpeedConfigModel, the config getters, torch_autocast."""

import copy

import pytest
import torch

from tests.unit.common import run_distributed


def _adam_reference(params, grads, steps, lr, betas, eps, weight_decay, decoupled):
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = cls(ref, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    for step in range(steps):
        for p, g in zip(ref, grads[step]):
            p.grad = g.clone()
        opt.step()
    return ref


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fused_adam_op_matches_torch(mode, weight_decay):
    from deepspeed.ops.adam.multi_tensor_apply import MultiTensorApply
    from deepspeed.ops.op_builder import FusedAdamBuilder
    builder = FusedAdamBuilder()
    assert builder.is_compatible()
    op = builder.load()
    torch.manual_seed(0)
    params = [torch.randn(3, 4), torch.randn(5), torch.randn(1)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(3)]
    lr, betas, eps = 0.01, (0.9, 0.99), 1e-6
    ours = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    apply = MultiTensorApply(2048 * 32)
    for step in range(3):
        apply(op.multi_tensor_adam, torch.zeros(1, dtype=torch.int), [grads[step], ours, m, v], lr, betas[0], betas[1],
              eps, step + 1, mode, True, weight_decay)
    ref = _adam_reference(params, grads, 3, lr, betas, eps, weight_decay, decoupled=mode == 1)
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
    before = [p.clone() for p in ours]
    op.multi_tensor_adam(1, torch.ones(1, dtype=torch.int), [grads[0], ours, m, v], lr, 0.9, 0.99, eps, 4, mode, True,
                         weight_decay)
    assert all(torch.equal(a, b) for a, b in zip(before, ours))  # the noop flag skips


def test_zenflow_selective_adamw_updates_selected_columns():
    from deepspeed.ops.adam import ZenFlowSelectiveAdamW
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 6))
    bias = torch.nn.Parameter(torch.randn(4))
    untouched = torch.nn.Parameter(torch.randn(3))
    opt = ZenFlowSelectiveAdamW([weight, bias, untouched], lr=0.05, weight_decay=0.01)
    columns = torch.tensor([1, 4, 5])
    ref_cols = torch.nn.Parameter(weight.detach()[:, columns].clone())
    ref_bias = torch.nn.Parameter(bias.detach().clone())
    ref_opt = torch.optim.AdamW([ref_cols, ref_bias], lr=0.05, weight_decay=0.01, foreach=False)
    start_weight, start_untouched = weight.detach().clone(), untouched.detach().clone()
    for _ in range(3):
        g_cols, g_bias = torch.randn(4, 3), torch.randn(4)
        weight.selected_indices, weight.selected_grad, bias.selected_grad = columns, g_cols, g_bias
        opt.step()
        assert weight.selected_grad is None and bias.selected_grad is None
        ref_cols.grad, ref_bias.grad = g_cols, g_bias
        ref_opt.step()
    assert torch.allclose(weight.detach()[:, columns], ref_cols.detach(), atol=1e-6)
    others = [c for c in range(6) if c not in columns.tolist()]
    assert torch.equal(weight.detach()[:, others], start_weight[:, others])
    assert torch.allclose(bias.detach(), ref_bias.detach(), atol=1e-6)
    assert torch.equal(untouched.detach(), start_untouched)
    assert opt.state[weight]["exp_avg"].shape == (4, 3)
    opt.clear_selected_mv()
    assert not opt.state[weight]["exp_avg"].any() and not opt.state[bias]["exp_avg_sq"].any()


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_cpu_adam_step_subgroup_and_rollback(adamw_mode):
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    torch.manual_seed(0)
    flat = torch.nn.Parameter(torch.randn(10))
    opt = DeepSpeedCPUAdam([flat], lr=0.01, weight_decay=0.1, adamw_mode=adamw_mode)
    grads = [torch.randn(10) for _ in range(3)]
    ref = _adam_reference([flat], [[g] for g in grads], 3, 0.01, (0.9, 0.999), 1e-8, 0.1, decoupled=adamw_mode)[0]
    start = flat.detach().clone()
    for g in grads:
        flat.grad = g.clone()
        opt.step_subgroup(7)
    assert set(opt.state) == {7} and opt.state[7]["step"] == 3
    assert torch.allclose(flat.detach(), ref.detach(), atol=1e-6)
    for g in reversed(grads):
        flat.grad = g.clone()
        opt.rollback_subgroup(7)
    assert opt.state[7]["step"] == 0
    assert torch.allclose(flat.detach(), start, atol=1e-5)
    assert torch.allclose(opt.state[7]["exp_avg"], torch.zeros(10), atol=1e-6)
    with pytest.raises(RuntimeError, match="step count"):
        opt.rollback_subgroup(7)


def coalesced_worker(sizes):
    import deepspeed.comm as dist
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced
    rank, world = dist.get_rank(), dist.get_world_size()
    tensors = [torch.arange(n, dtype=torch.float32).reshape(-1) * (rank + 1) + rank for n in sizes]
    originals = [t.clone() for t in tensors]
    out = reduce_scatter_coalesced(tensors)
    ok = all(torch.equal(a, b) for a, b in zip(tensors, originals))  # inputs untouched
    for n, piece in zip(sizes, out):
        mean = sum(torch.arange(n, dtype=torch.float32) * (r + 1) + r for r in range(world)) / world
        chunk = -(-n // world)
        expected = mean[rank * chunk:min((rank + 1) * chunk, n)]
        ok = ok and piece.shape == expected.shape and torch.allclose(piece, expected)
    return ok


@pytest.mark.parametrize("world,sizes", [(2, [6, 5, 1]), (3, [7, 2]), (3, [9])])
def test_reduce_scatter_coalesced_is_the_mean(world, sizes):
    assert run_distributed(coalesced_worker, world, args=(sizes, ), timeout=60) == [True] * world


def test_sparse_tensor_round_trip():
    from deepspeed.runtime.sparse_tensor import SparseTensor
    emb = torch.nn.Embedding(6, 3, sparse=True)
    emb(torch.tensor([1, 4, 1])).sum().backward()
    sparse = SparseTensor(emb.weight.grad)
    assert sparse.indices.tolist() == [1, 4] and sparse.dense_size == [6, 3] and SparseTensor.type() == \
        "deepspeed.SparseTensor"
    assert torch.equal(sparse.to_dense(), emb.weight.grad.to_dense())
    assert sparse.sparse_size() == (2 + 6, 18)
    sparse.add(SparseTensor(emb.weight.grad))
    assert torch.equal(sparse.to_coo_tensor().to_dense(), 2 * emb.weight.grad.to_dense())
    with pytest.raises(ValueError, match="sparse"):
        SparseTensor(torch.ones(2, 2))


def test_torch_checkpoint_engine_round_trip(tmp_path):
    from deepspeed.runtime.checkpoint_engine import (CheckpointCommitInfo, TorchCheckpointEngine,
                                                     create_checkpoint_engine)
    from deepspeed.runtime.config import DeepSpeedConfig
    config = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1})
    engine = create_checkpoint_engine(config, None, 0, False, False)
    assert isinstance(engine, TorchCheckpointEngine) and engine.zipfile_serialization
    state = {"w": torch.arange(4.0), "step": 3}
    path = str(tmp_path / "sub" / "x.pt")
    engine.makedirs(str(tmp_path / "sub"), exist_ok=True)
    info = CheckpointCommitInfo(tag="t", save_dir=str(tmp_path), save_latest=True)
    engine.create(info)
    engine.save(state, path)
    assert engine.commit(info) is True
    loaded = engine.load(path)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    assert engine.is_data_parallel_writer(0) and not engine.is_data_parallel_writer(1) and not engine.is_decoupled()
    from deepspeed.runtime.checkpoint_engine import DecoupledCheckpointEngine, FastCheckpointEngine
    writer = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "checkpoint": {"writer": {}}})
    assert type(create_checkpoint_engine(writer, None, 0, False, False)) is FastCheckpointEngine
    decoupled = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "checkpoint": {"writer": {"decoupled": True}}})
    assert create_checkpoint_engine(decoupled, None, 0, False, False).is_decoupled()
    assert isinstance(create_checkpoint_engine(decoupled, None, 0, False, False), DecoupledCheckpointEngine)


def test_deepspeed_config_model_deprecations():
    pydantic = pytest.importorskip("pydantic")
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel, get_config_default

    class Inner(DeepSpeedConfigModel):
        size: int = 1

    class Section(DeepSpeedConfigModel):
        new_size: int = 0
        inner: Inner = Inner()
        old_size: str = pydantic.Field("0",
                                       json_schema_extra={
                                           "deprecated": True,
                                           "new_param": "new_size",
                                           "new_param_fn": int
                                       })
        old_inner: int = pydantic.Field(0, json_schema_extra={"deprecated": True, "new_param": "inner.size"})
        note_only: int = pydantic.Field(0, json_schema_extra={"deprecated": True, "deprecated_msg": "unused"})

    assert Section(old_size="5").new_size == 5
    assert Section(old_inner=7).inner.size == 7
    assert Section(new_size="auto").new_size == 0  # "auto" left for the framework: the default stays
    assert Section(note_only=3).note_only == 3
    with pytest.raises(AssertionError, match="together"):
        Section(old_size="5", new_size=6)
    with pytest.raises(pydantic.ValidationError):
        Section(unknown=1)
    with pytest.raises(pydantic.ValidationError):
        Section(new_size="auto", strict=True)
    assert get_config_default(Section, "new_size") == 0


def test_deepspeed_config_model_without_pydantic_names_the_extra(monkeypatch):
    """Without pydantic 2 the name raises an ImportError saying what to install, and setup.py declares that extra."""
    import ast
    import os
    import sys
    monkeypatch.delitem(sys.modules, "deepspeed.runtime.configuration.model", raising=False)
    monkeypatch.setitem(sys.modules, "pydantic", None)  # an import of pydantic fails as if it were not installed
    with pytest.raises(ImportError, match=r"pip install 'deepspeed\[pydantic\]'") as raised:
        from deepspeed.runtime.config_utils import DeepSpeedConfigModel  # noqa: F401
    assert raised.value.name == "pydantic"
    import deepspeed
    setup_py = os.path.join(os.path.dirname(os.path.dirname(deepspeed.__file__)), "setup.py")
    if not os.path.isfile(setup_py):
        pytest.skip("not a source checkout")
    extras = next(keyword.value for node in ast.walk(ast.parse(open(setup_py).read()))
                  if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup"
                  for keyword in node.keywords if keyword.arg == "extras_require")
    declared = {ast.literal_eval(key): value for key, value in zip(extras.keys, extras.values)}
    assert ast.literal_eval(declared["pydantic"]) == ["pydantic>=2"]


def test_config_getters_and_precision_config():
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime import precision_config as pc
    raw = {"gradient_clipping": 0.5, "log_level": "info", "optimizer": {"type": "AdamW", "params": {"lr": 1}},
           "checkpoint": {"tag_validation": "fail"}, "communication_data_type": "bf16"}  # yapf: disable
    assert ds_config.get_gradient_clipping(raw) == 0.5 and ds_config.get_gradient_clipping({}) == 1.0
    assert ds_config.get_log_level(raw) == "info" and ds_config.get_log_level({}) is None
    assert ds_config.get_optimizer_name(raw) == "AdamW" and ds_config.get_optimizer_params(raw) == {"lr": 1}
    assert ds_config.get_checkpoint_tag_validation_mode(raw["checkpoint"]) == "FAIL"
    assert ds_config.get_communication_data_type(raw) == torch.bfloat16
    assert ds_config.ADAM_OPTIMIZER == "adam" and ds_config.ADAMW_OPTIMIZER == "adamw"
    with pytest.raises(ds_config.DeepSpeedConfigError):
        ds_config.get_checkpoint_tag_validation_mode({"tag_validation": "maybe"})
    fp16 = pc.get_float16_config({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}})
    assert fp16.enabled and fp16.initial_dynamic_scale() == 2**8
    assert fp16.dynamic_loss_scale_args()[pc.INITIAL_LOSS_SCALE] == 2**8
    assert pc.get_bfloat16_config({pc.BFLOAT16_OLD: {"enabled": True}}).enabled


def autocast_worker():
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "torch_autocast": {"enabled": True, "dtype": "bf16"}}  # yapf: disable
    engine = deepspeed.initialize(model=model, config=cfg)[0]
    x = torch.randn(2, 4)
    out = engine(x)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        ref_out = plain(x)
    ok = out.dtype == torch.bfloat16 and torch.equal(out, ref_out)
    ok = ok and all(p.dtype == torch.float32 for p in engine.module.parameters())
    ok = ok and engine.module[0].weight.comm_dtype == torch.bfloat16
    engine.backward(out.float().pow(2).sum())
    ref_out.float().pow(2).sum().backward()
    from deepspeed.utils import safe_get_full_grad
    ok = ok and all(
        torch.allclose(safe_get_full_grad(p), q.grad) for p, q in zip(engine.module.parameters(), plain.parameters()))
    engine.step()
    engine.destroy()
    return ok


def test_torch_autocast_forward():
    assert run_distributed(autocast_worker, 1, timeout=60) == [True]


def test_torch_autocast_helpers():
    from deepspeed.runtime import torch_autocast as ta
    assert ta.get_default_autocast_lower_precision_modules()[0] == "torch.nn.modules.linear.Linear"
    p = torch.nn.Parameter(torch.ones(1))
    assert not ta.has_comm_dtype(p) and ta.get_comm_dtype(p) == torch.float32
    p.comm_dtype = torch.bfloat16
    assert ta.get_all_comm_dtypes([p, torch.nn.Parameter(torch.ones(1))]) == {torch.bfloat16, torch.float32}
    assert ta.sort_dtypes([torch.float32, torch.bfloat16]) == [torch.bfloat16, torch.float32]
    with pytest.raises(NotImplementedError, match="fp16"):
        ta.resolve_autocast_dtype(torch.float16)
