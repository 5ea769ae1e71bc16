# SPDX-License-Identifier: Apache-2.0
"""ZeRO-side names: DeepSpeedZeroConfig(**kwargs), the ZeRO-3 linear and tiling layers, zero.utils,
offload_states, unwrap_model_for_generation, and the optimizer classes initialize returns."""

import collections
import itertools

import pytest
import torch

from tests.unit.common import run_distributed


def test_zero_config_keyword_construction():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig, OffloadDeviceEnum)
    assert DeepSpeedZeroConfig(stage3_prefetch_bucket_size=12).prefetch_bucket_size == 12
    assert DeepSpeedZeroConfig(stage3_param_persistence_threshold=7).param_persistence_threshold == 7
    assert DeepSpeedZeroConfig(stage3_max_live_parameters=3).max_live_parameters == 3
    assert DeepSpeedZeroConfig(stage3_max_reuse_distance=4).max_reuse_distance == 4
    assert DeepSpeedZeroConfig(stage3_gather_16bit_weights_on_model_save=True).gather_16bit_weights_on_model_save
    assert DeepSpeedZeroConfig(stage3_gather_fp16_weights_on_model_save=True).gather_16bit_weights_on_model_save
    assert DeepSpeedZeroConfig(prefetch_bucket_size=9).stage3_prefetch_bucket_size == 9
    for stage in (0, 1, 2):
        assert DeepSpeedZeroConfig(stage=stage).overlap_comm is False
        assert DeepSpeedZeroConfig(stage=stage).pipeline_loading_checkpoint is False
    assert DeepSpeedZeroConfig(stage=3).overlap_comm is True
    plain = DeepSpeedZeroConfig()
    assert plain.stage == 0 and plain.offload_param is None and plain.offload_optimizer is None
    assert DeepSpeedZeroConfig(offload_param=None, offload_optimizer=None).offload_param is None
    built = DeepSpeedZeroConfig(offload_param={}, offload_optimizer={})
    assert isinstance(built.offload_param, DeepSpeedZeroOffloadParamConfig)
    assert isinstance(built.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
    section = DeepSpeedZeroOffloadParamConfig.from_dict({"device": "cpu"}, "offload_param")
    assert DeepSpeedZeroConfig(stage=3, offload_param=section).offload_param is section
    deprecated = DeepSpeedZeroConfig(cpu_offload=True, cpu_offload_use_pin_memory=True)
    assert deprecated.offload_optimizer.device == OffloadDeviceEnum.cpu and deprecated.offload_optimizer.pin_memory
    assert DeepSpeedZeroConfig(stage=3, cpu_offload_param=True).offload_param.device == OffloadDeviceEnum.cpu
    with pytest.raises(AssertionError, match="cpu_offload"):
        DeepSpeedZeroConfig(cpu_offload=True, offload_optimizer={"device": "cpu"})
    with pytest.raises(ValueError, match="unknown config key"):
        DeepSpeedZeroConfig(no_such_key=1)
    # the same object as the dict form
    assert DeepSpeedZeroConfig(stage=2, reduce_bucket_size=10) == DeepSpeedZeroConfig.from_dict(
        {
            "stage": 2,
            "reduce_bucket_size": 10
        }, "zero_optimization")


@pytest.mark.parametrize("shape", [(5, ), (3, 5), (2, 3, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_zero3_linear_matches_torch(shape, bias):
    from deepspeed.runtime.zero.linear import LinearModuleForZeroStage3, zero3_linear_wrap
    torch.manual_seed(0)
    layer = LinearModuleForZeroStage3(5, 4, bias=bias)
    reference = torch.nn.Linear(5, 4, bias=bias)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(shape, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, ref = layer(x), reference(x_ref)
    assert torch.allclose(out, ref, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-6)
    assert torch.allclose(layer.weight.grad, reference.weight.grad, atol=1e-5)
    if bias:
        assert torch.allclose(layer.bias.grad, reference.bias.grad, atol=1e-6)
    assert torch.allclose(zero3_linear_wrap(x, layer.weight, layer.bias), ref, atol=1e-6)


@pytest.mark.parametrize("shape", [(5, ), (3, 5), (2, 3, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_zero3_linear_follows_autocast(shape, dtype):
    """Under torch.autocast the output takes the autocast dtype, and output and gradients are torch.nn.Linear's."""
    from deepspeed.runtime.zero.linear import LinearModuleForZeroStage3
    torch.manual_seed(0)
    layer = LinearModuleForZeroStage3(5, 4)
    reference = torch.nn.Linear(5, 4)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(shape, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=dtype):
        out, ref = layer(x), reference(x_ref)
    assert out.dtype == ref.dtype == dtype
    assert torch.equal(out, ref)
    grad = torch.randn(out.shape).to(dtype)
    out.backward(grad)
    ref.backward(grad)
    for got, want in ((x.grad, x_ref.grad), (layer.weight.grad, reference.weight.grad), (layer.bias.grad,
                                                                                         reference.bias.grad)):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    with torch.autocast("cpu", enabled=False):  # autocast off inside an autocast region: the weights' dtype
        assert layer(x).dtype == torch.float32


def test_autocast_custom_decorators():
    """Upstream's ``autocast_custom_fwd`` / ``_bwd``: torch.amp's decorators bound to the accelerator's device type;
    a custom function decorated with them runs its forward under the caller's autocast and its backward under the
    same state, as torch.amp documents."""
    import functools
    from deepspeed.runtime.zero import linear as zero_linear
    assert isinstance(zero_linear.autocast_custom_fwd, functools.partial)
    assert zero_linear.autocast_custom_fwd.func is torch.amp.custom_fwd
    assert zero_linear.autocast_custom_bwd.func is torch.amp.custom_bwd
    assert zero_linear.autocast_custom_fwd.keywords == {"device_type": "cpu"}

    seen = {}

    class Matmul(torch.autograd.Function):

        @staticmethod
        @zero_linear.autocast_custom_fwd
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a @ b

        @staticmethod
        @zero_linear.autocast_custom_bwd
        def backward(ctx, grad):
            seen["autocast"] = torch.is_autocast_enabled("cpu")
            a, b = ctx.saved_tensors
            return grad @ b.t(), a.t() @ grad

    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = Matmul.apply(a, b)
        assert out.dtype == torch.bfloat16  # the forward ran under the caller's autocast
    out.float().sum().backward()
    assert seen["autocast"] is True  # the backward, outside the region, ran under the forward's state
    torch.testing.assert_close(a.grad, torch.ones(3, 2) @ b.t(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape", [(5, ), (3, 5), (2, 3, 5)])
def test_zero3_linear_backward_autocast_and_torch_func(shape):
    """The backward of an fp32 forward is not changed by an autocast region around it; torch.func.grad and vmap
    run through the function."""
    from deepspeed.runtime.zero.linear import LinearModuleForZeroStage3, zero3_linear_wrap
    torch.manual_seed(0)
    layer = LinearModuleForZeroStage3(5, 4)
    reference = torch.nn.Linear(5, 4)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(shape)
    plain = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain.sum().backward()
    reference(x).sum().backward()
    assert layer.weight.grad.dtype == torch.float32
    assert torch.allclose(layer.weight.grad, reference.weight.grad, atol=1e-6)
    w, b = layer.weight.detach(), layer.bias.detach()
    grads = torch.func.grad(lambda w_, x_: zero3_linear_wrap(x_, w_, b).pow(2).sum(), argnums=(0, 1))(w, x)
    expected = torch.func.grad(lambda w_, x_: torch.nn.functional.linear(x_, w_, b).pow(2).sum(), argnums=(0, 1))(w, x)
    assert all(torch.allclose(g, e, atol=1e-5) for g, e in zip(grads, expected))
    batch = torch.randn(3, *shape)
    assert torch.allclose(torch.func.vmap(lambda xi: zero3_linear_wrap(xi, w, b))(batch), reference(batch), atol=1e-6)


@pytest.mark.parametrize("in_f,out_f,in_splits,out_splits", [(7, 5, 3, 2), (4, 9, 1, 4), (6, 6, 6, 1), (1, 3, 1, 3)])
def test_tiled_linear_matches_linear(in_f, out_f, in_splits, out_splits):
    from deepspeed.runtime.zero.tiling import TiledLinear
    torch.manual_seed(1)
    reference = torch.nn.Linear(in_f, out_f)
    tiled = TiledLinear(in_f, out_f, in_splits=in_splits, out_splits=out_splits, init_linear=reference)
    assert len(tiled.linears) == out_splits and all(len(row) == in_splits for row in tiled.linears)
    x = torch.randn(2, 3, in_f, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, ref = tiled(x), reference(x_ref)
    assert torch.allclose(out, ref, atol=1e-6)
    out.sum().backward()
    ref.sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-6)
    weight_grad = torch.cat([torch.cat([t.weight.grad for t in row], dim=1) for row in tiled.linears], dim=0)
    assert torch.allclose(weight_grad, reference.weight.grad, atol=1e-5)
    split = TiledLinear(in_f,
                        out_f,
                        in_splits=in_splits,
                        out_splits=out_splits,
                        combine_out_splits=False,
                        init_linear=reference)
    assert torch.allclose(torch.cat(split(x.detach()), dim=-1), ref.detach(), atol=1e-6)
    with pytest.raises(RuntimeError):
        TiledLinear(in_f, out_f, in_splits=in_f + 1)


def test_tiled_linear_return_bias():
    from deepspeed.runtime.zero.tiling import TiledLinearReturnBias

    class BiasReturning(torch.nn.Linear):

        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight), self.bias

    torch.manual_seed(2)
    reference = torch.nn.Linear(6, 4)
    tiled = TiledLinearReturnBias(6, 4, in_splits=2, out_splits=2, linear_cls=BiasReturning, init_linear=reference)
    x = torch.randn(3, 6)
    out, bias = tiled(x)
    assert torch.allclose(out, torch.nn.functional.linear(x, reference.weight), atol=1e-6)
    assert torch.allclose(bias, reference.bias)


def test_zero_utils():
    from deepspeed.ops.adam import FusedAdam
    from deepspeed.runtime.zero import utils as zu
    params = [torch.nn.Parameter(torch.ones(2))]
    assert zu.is_zero_supported_optimizer(torch.optim.AdamW(params))
    assert zu.is_zero_supported_optimizer(FusedAdam(params))
    assert not zu.is_zero_supported_optimizer(torch.optim.SGD(params, lr=0.1))
    Point = collections.namedtuple("Point", "x y")
    value = {"a": [torch.ones(1), (2, torch.ones(2))], "p": Point(torch.ones(3), "s")}
    doubled = zu.apply_to_tensors_only(lambda t: t * 2, value)
    assert torch.equal(doubled["a"][0], torch.full((1, ), 2.0)) and doubled["a"][1][0] == 2
    assert isinstance(doubled["p"], Point) and torch.equal(doubled["p"].x, torch.full((3, ), 2.0))
    assert zu.isinstance_namedtuple(Point(1, 2)) and not zu.isinstance_namedtuple((1, 2))
    assert zu.is_builtin_type(3) and not zu.is_builtin_type(torch.ones(1))
    tensors = [torch.arange(3.0), torch.arange(4.0).view(2, 2)]
    assert [(o, n) for _, o, n in zu.get_mapping_to_flat_buffer(tensors)] == [(0, 3), (3, 4)]
    flat = zu.defragment(tensors)
    assert torch.equal(flat, torch.tensor([0.0, 1, 2, 0, 1, 2, 3]))
    assert tensors[1].data_ptr() == flat.data_ptr() + 3 * flat.element_size()


def test_offload_and_reload_optimizer_states():
    from deepspeed.runtime.zero import offload_states as os_
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.randn(4)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    exp_avg = opt.state[p]["exp_avg"]
    os_.offload_adam_states(opt, "cpu")
    assert opt.state[p]["exp_avg"] is exp_avg and "exp_avg_offload_buffer" in opt.state[p]
    os_.reload_adam_states(opt, "cpu")
    assert torch.equal(opt.state[p]["exp_avg"], before["exp_avg"])
    os_.offload_optimizer_states(opt, "cpu")
    replaced = os_.reload_optimizer_states(opt, "cpu")
    assert len(replaced) >= 3 and torch.equal(opt.state[p]["exp_avg_sq"], before["exp_avg_sq"])
    with pytest.raises(TypeError, match="DeepSpeed engine"):
        os_.get_state_devices(None, os_.OffloadStateTypeEnum.optim_states)


def _net():
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def _zero3_sgd_engine():
    """A ZeRO-3 engine over ``_net()`` (one unit per layer, SGD, no clipping) and a plain copy of the model."""
    import copy

    import deepspeed
    torch.manual_seed(0)
    model = _net()
    plain = copy.deepcopy(model)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1}
    }  # yapf: disable
    return deepspeed.initialize(model=model, config=cfg)[0], model, plain


def generation_worker():
    from deepspeed.runtime.zero import ZeroParamStatus, unwrap_model_for_generation
    engine, model, plain = _zero3_sgd_engine()
    x = torch.randn(2, 4)
    hooked = len(engine.optimizer.forward_hooks)
    with torch.no_grad(), unwrap_model_for_generation(engine) as unwrapped:
        assert unwrapped is engine
        assert engine.optimizer.forward_hooks == []  # as upstream's: no hooks inside
        outputs = [unwrapped.module(x) for _ in range(3)]
        held = all(p.ds_status == ZeroParamStatus.AVAILABLE for p in engine.module.parameters())
    released = all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters())
    assert hooked and len(engine.optimizer.forward_hooks) == hooked
    expected = plain(x)
    same = all(torch.allclose(o, expected, atol=1e-6) for o in outputs)
    # training afterwards still matches plain SGD
    loss = engine(x).pow(2).sum()
    engine.backward(loss)
    engine.step()
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    ref_loss = plain(x).pow(2).sum()
    torch.autograd.backward(ref_loss)  # one rank's loss; the engine averages equal losses over ranks
    ref_opt.step()
    from deepspeed.utils import safe_get_full_fp32_param
    trained = all(
        torch.allclose(safe_get_full_fp32_param(p), q, atol=1e-5)
        for p, q in zip(engine.module.parameters(), plain.parameters()))
    engine.destroy()
    return held, released, same, trained


def test_unwrap_model_for_generation_zero3():
    assert run_distributed(generation_worker, 2, timeout=90) == [(True, True, True, True)] * 2


def trl_generation_worker():
    """The calls TRL's unwrap_model_for_generation makes on a ZeRO-3 engine (its remove_hooks / add_hooks inside
    GatheredParameters over every parameter), then training: outputs and parameters as plain torch's."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    engine, model, plain = _zero3_sgd_engine()
    x = torch.randn(2, 4)
    engine.backward(engine(x).pow(2).sum())  # a step before generation, as in RL loops
    engine.step()
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(x).pow(2).sum().backward()
    ref_opt.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        offload = engine.optimizer  # no parameter_offload attribute here: the optimizer answers for it
        assert not hasattr(offload, "parameter_offload")
        for module in offload.module.modules():
            for _, param in itertools.chain(module.named_parameters(recurse=False), module.ds_external_parameters()):
                param.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks:
            hook.remove()
        for hook in offload.backward_hooks:
            hook.remove()
        offload.forward_hooks = []
        offload.backward_hooks = []
        with torch.no_grad():
            generated = [engine.module(x) for _ in range(2)]
        offload._register_deepspeed_module(offload.module)
    ref_opt.zero_grad()
    same = all(torch.allclose(g, plain(x), atol=1e-6) for g in generated)
    engine.backward(engine(x).pow(2).sum())
    engine.step()
    plain(x).pow(2).sum().backward()
    ref_opt.step()
    trained = all(
        torch.allclose(safe_get_full_fp32_param(p), q, atol=1e-5)
        for p, q in zip(engine.module.parameters(), plain.parameters()))
    rehooked = len(engine.optimizer.forward_hooks) > 0
    engine.destroy()
    return same, trained, rehooked


def test_trl_unwrap_model_for_generation_calls():
    assert run_distributed(trl_generation_worker, 2, timeout=90) == [(True, True, True)] * 2


def returned_class_worker(stage, dtype, optimizer_type, accum):
    import deepspeed
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": optimizer_type, "params": {"lr": 0.1}},
           "zero_optimization": {"stage": stage}}  # yapf: disable
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True}
    if accum:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    engine, optimizer, _, _ = deepspeed.initialize(model=_net(), config=cfg)
    name = type(optimizer).__name__
    x = torch.randn(1, 4)
    engine.backward(engine(x.to(engine.module[0].weight.dtype)).float().sum())
    engine.step()
    # upstream's names for the fp32 master partitions: on one rank, the group's values after the step
    view = {
        "DeepSpeedZeroOptimizer": "single_partition_of_fp32_groups",
        "DeepSpeedZeroOptimizer_Stage3": "fp32_partitioned_groups_flat"
    }.get(name)
    if view is not None:
        from deepspeed.utils import safe_get_full_fp32_param
        parts = getattr(optimizer, view)
        full = torch.cat([safe_get_full_fp32_param(p).flatten() for p in engine.module.parameters()])
        padded = torch.cat([full, full.new_zeros(parts[0].numel() - full.numel())])  # the layout's order and padding
        assert len(parts) == 1 and parts[0].dtype == torch.float32
        assert torch.equal(parts[0].detach().sort().values, padded.sort().values)
    engine.destroy()
    return name


@pytest.mark.parametrize("stage,dtype,optimizer_type,accum,expected", [
    (1, "fp32", "Adam", None, "DeepSpeedZeroOptimizer"),
    (2, "bf16", "Adam", None, "DeepSpeedZeroOptimizer"),
    (1, "bf16", "Adam", "fp32", "BF16_Optimizer"),
    (3, "fp32", "Adam", None, "DeepSpeedZeroOptimizer_Stage3"),
    (0, "fp16", "Adam", None, "FP16_Optimizer"),
    (0, "bf16", "SGD", None, "FP16_UnfusedOptimizer"),
    (0, "fp32", "Adam", None, "EngineOptimizer"),
])
def test_returned_optimizer_class(stage, dtype, optimizer_type, accum, expected):
    assert run_distributed(returned_class_worker, 1, args=(stage, dtype, optimizer_type, accum),
                           timeout=60) == [expected]
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
    from deepspeed.runtime.engine_parts.returned_optimizers import returned_optimizer_class
    from deepspeed.ops.adam import FusedAdam
    inner = FusedAdam([torch.nn.Parameter(torch.ones(1))]) if optimizer_type == "Adam" else torch.optim.SGD(
        [torch.nn.Parameter(torch.ones(1))], lr=0.1)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    cls = returned_optimizer_class(stage, dtypes[dtype], dtypes.get(accum), inner, False)
    assert cls.__name__ == expected and issubclass(cls, DeepSpeedOptimizer)


def test_partition_parameters_names():
    from deepspeed.runtime.zero.partition_parameters import (Init, InsertPostInitMethodToModuleSubClasses,
                                                             MultipleAllGatherHandles, partitioned_param_data_shape)
    assert issubclass(Init, InsertPostInitMethodToModuleSubClasses) and partitioned_param_data_shape == [0]
    waited = []

    class Handle:

        def __init__(self, i):
            self.i = i

        def wait(self):
            waited.append(self.i)

    MultipleAllGatherHandles([Handle(1), Handle(2)]).wait()
    assert waited == [1, 2]
    built = []

    class Recorder(InsertPostInitMethodToModuleSubClasses):

        def _post_init_method(self, module):
            built.append(type(module).__name__)

    with Recorder():
        _net()
    assert built == ["Linear", "Linear", "Sequential"]  # Tanh runs torch.nn.Module's own __init__ only
    built.clear()
    torch.nn.Linear(1, 1)
    assert built == []


def contradicting_group_worker(launcher_world, explicit):
    import os
    import deepspeed
    import deepspeed.comm as dist
    os.environ["WORLD_SIZE"] = launcher_world  # what a launcher that started several ranks would say
    group = dist.new_group([0]) if explicit else None
    try:
        with deepspeed.zero.Init(data_parallel_group=group):
            layer = torch.nn.Linear(3, 2)
    except RuntimeError as err:
        return str(err)
    return layer.weight.ds_numel


@pytest.mark.parametrize("launcher_world,explicit,expected", [("4", False, "WORLD_SIZE=4"), ("1", False, 6),
                                                              ("4", True, 6)])
def test_zero_init_refuses_a_single_rank_group_under_a_multi_rank_launcher(launcher_world, explicit, expected):
    """A size-1 default group while the launcher reports several ranks would leave every rank the whole model:
    zero.Init raises, naming the fix; an explicit group of one rank is taken as intended."""
    from deepspeed.runtime.zero.partition_parameters import _contradicting_single_rank_pg_error
    assert _contradicting_single_rank_pg_error(1, None, {"WORLD_SIZE": "not-a-number"}) is None
    assert _contradicting_single_rank_pg_error(2, None, {"WORLD_SIZE": "4"}) is None
    outcome = run_distributed(contradicting_group_worker, 1, args=(launcher_world, explicit), timeout=60)[0]
    if isinstance(expected, str):
        assert expected in outcome and "init_distributed" in outcome, outcome
    else:
        assert outcome == expected
