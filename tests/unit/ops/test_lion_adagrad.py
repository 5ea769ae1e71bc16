# SPDX-License-Identifier: Apache-2.0
"""Lion (``FusedLion``, ``DeepSpeedCPULion``) and the host Adagrad (``DeepSpeedCPUAdagrad``) against plain torch.

References, written here without the package: Lion as the paper states it, one tensor at a time
(``p <- p (1 - lr wd) - lr sign(b1 m + (1 - b1) g)``, ``m <- b2 m + (1 - b2) g``), and ``torch.optim.Adagrad``.
Shapes come from a seeded generator (odd and 1-wide layers included); the engine cells train a random MLP on two
ranks at every ZeRO stage, with and without optimizer offload, and compare each parameter with a plain-torch run of
the same global batches.
"""

import pytest
import torch

from tests.unit.common import run_distributed


class ReferenceLion:
    """Lion one tensor at a time, on copies of ``params``; a 16-bit parameter starts each step from its rounded
    value and is rounded once after it, the momentum kept in float32 (``fp32_moments``) or in the parameter's
    dtype."""

    def __init__(self, params, lr, betas, weight_decay, fp32_moments=True):
        self.values = [p.detach().clone() for p in params]
        self.moments = [torch.zeros_like(p, dtype=torch.float32 if fp32_moments else p.dtype) for p in params]
        self.lr, self.betas, self.weight_decay = lr, betas, weight_decay

    def step(self, grads):
        beta1, beta2 = self.betas
        for i, g in enumerate(grads):
            p, m, g = self.values[i].float(), self.moments[i].float(), g.float()
            direction = torch.sign(beta1 * m + (1 - beta1) * g)
            p = p * (1 - self.lr * self.weight_decay) - self.lr * direction
            m = beta2 * m + (1 - beta2) * g
            self.values[i] = p.to(self.values[i].dtype)
            self.moments[i] = m.to(self.moments[i].dtype)
        return self.values


def reference_lion(params, grads_per_step, lr, betas, weight_decay, fp32_moments=True):
    """Parameters after the given steps (each step a list of gradients)."""
    reference = ReferenceLion(params, lr, betas, weight_decay, fp32_moments)
    for grads in grads_per_step:
        reference.step(grads)
    return reference.values


def random_shapes(seed, count=4):
    gen = torch.Generator().manual_seed(seed)
    shapes = []
    for _ in range(count):
        rank = int(torch.randint(1, 3, (1, ), generator=gen))
        shapes.append(tuple(int(torch.randint(1, 8, (1, ), generator=gen)) for _ in range(rank)))
    return shapes + [(1, ), (7, 1)]


def make_params(shapes, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def make_grads(shapes, steps, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed + 1)
    return [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(steps)]


def run_optimizer(optimizer, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cls_name", ["FusedLion", "DeepSpeedCPULion"])
def test_lion_fp32_matches_reference(seed, cls_name):
    import deepspeed.ops.lion as lion
    shapes = random_shapes(seed)
    params = make_params(shapes, torch.float32, seed)
    expected = reference_lion(params, make_grads(shapes, 5, seed), 0.01, (0.9, 0.99), 0.1)
    optimizer = getattr(lion, cls_name)(params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    run_optimizer(optimizer, params, make_grads(shapes, 5, seed))
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)
    state = optimizer.state[params[0]]
    assert set(state) == {"step", "exp_avg"} and state["step"] == 5  # upstream's layout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls_name,fp32_moments", [("DeepSpeedCPULion", True), ("FusedLion", False)])
def test_lion_16bit_steps_through_fp32(dtype, cls_name, fp32_moments):
    import deepspeed.ops.lion as lion
    shapes = random_shapes(3)
    params = make_params(shapes, dtype, 3)
    expected = reference_lion(params, make_grads(shapes, 4, 3, dtype), 1e-2, (0.9, 0.99), 0.05, fp32_moments)
    optimizer = getattr(lion, cls_name)(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05)
    run_optimizer(optimizer, params, make_grads(shapes, 4, 3, dtype))
    for p, e in zip(params, expected):
        assert p.dtype == dtype
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=0)
    moment = optimizer.state[params[0]]["exp_avg"]
    assert moment.dtype == (torch.float32 if fp32_moments else dtype)


@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_adagrad_matches_torch_adagrad(seed):
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    shapes = random_shapes(seed)
    ours, theirs = make_params(shapes, torch.float32, seed), make_params(shapes, torch.float32, seed)
    run_optimizer(DeepSpeedCPUAdagrad(ours, lr=0.05, eps=1e-8, weight_decay=0.1), ours, make_grads(shapes, 6, seed))
    run_optimizer(torch.optim.Adagrad(theirs, lr=0.05, eps=1e-8, weight_decay=0.1), theirs,
                  make_grads(shapes, 6, seed))
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def test_cpu_adagrad_sparse_rows_match_torch_adagrad():
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    torch.manual_seed(0)
    ours, theirs = torch.nn.Embedding(11, 3, sparse=True), torch.nn.Embedding(11, 3, sparse=True)
    theirs.load_state_dict(ours.state_dict())
    opt_ours = DeepSpeedCPUAdagrad(ours.parameters(), lr=0.1)
    opt_theirs = torch.optim.Adagrad(theirs.parameters(), lr=0.1)
    untouched = ours.weight.detach()[10].clone()
    for step in range(4):
        ids = torch.randint(0, 10, (6, ))  # row 10 never used
        for module, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            module(ids).pow(2).sum().backward()
            assert module.weight.grad.is_sparse
            opt.step()
    torch.testing.assert_close(ours.weight.detach(), theirs.weight.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(ours.weight.detach()[10], untouched)
    with pytest.raises(RuntimeError, match="weight_decay"):
        opt = DeepSpeedCPUAdagrad(ours.parameters(), weight_decay=0.1)
        ours(torch.tensor([1])).sum().backward()
        opt.step()


def test_host_optimizers_refuse_device_parameters():
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.lion import DeepSpeedCPULion
    for cls in (DeepSpeedCPULion, DeepSpeedCPUAdagrad):
        param = torch.nn.Parameter(torch.empty(4, device="meta"))
        param.grad = torch.empty(4, device="meta")
        with pytest.raises(AssertionError, match="host"):
            cls([param]).step()


def test_invalid_arguments_raise():
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.lion import FusedLion
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="betas"):
        FusedLion(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="learning rate"):
        FusedLion(p, lr=-1)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        DeepSpeedCPUAdagrad(p, amsgrad=True)


def test_ops_under_upstream_names():
    """The op modules the builders load: upstream's functions, same maths as the optimizers."""
    from deepspeed.ops.op_builder import CPUAdagradBuilder, CPULionBuilder, FusedLionBuilder
    shapes = [(5, ), (2, 3)]
    p_ref = make_params(shapes, torch.float32, 7)
    grads = make_grads(shapes, 3, 7)
    expected = reference_lion(p_ref, grads, 0.02, (0.9, 0.99), 0.01)
    fused = FusedLionBuilder().load()
    params = make_params(shapes, torch.float32, 7)
    moments = [torch.zeros_like(p) for p in params]
    for step, g in enumerate(grads, 1):
        fused.multi_tensor_lion(2048, torch.zeros(1, dtype=torch.int), [g, [p.data for p in params], moments], 0.02,
                                0.9, 0.99, step, 0.01)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)
    cpu = CPULionBuilder().load()
    cpu.create_lion(5, 0.02, 0.9, 0.99, 0.01, False)
    params = make_params(shapes, torch.float32, 7)
    moments = [torch.zeros_like(p) for p in params]
    for step, g in enumerate(grads, 1):
        for p, gi, m in zip(params, g, moments):
            cpu.lion_update(5, step, 0.02, 0.9, 0.99, 0.01, p.data, gi, m)
    cpu.destroy_lion(5)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)
    adagrad = CPUAdagradBuilder().load()
    adagrad.create_adagrad(3, 0.05, 1e-8, 0.0, False)
    ours, theirs = make_params(shapes, torch.float32, 7), make_params(shapes, torch.float32, 7)
    sums = [torch.zeros_like(p) for p in ours]
    reference = torch.optim.Adagrad(theirs, lr=0.05, eps=1e-8)
    for step, g in enumerate(grads, 1):
        for p, gi, s in zip(ours, g, sums):
            adagrad.adagrad_update(3, step, 0.05, 1e-8, 0.0, p.data, gi, s)
        run_optimizer(reference, theirs, [g])
    adagrad.destroy_adagrad(3)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- the engine, two ranks
LR, BETAS, WD, CLIP = 0.01, (0.9, 0.99), 0.02, 0.5
STEPS, MICRO = 3, 2
# (optimizer type, stage, offload) -> the class the engine steps with
CELLS = [("Lion", 0, False, "FusedLion"), ("Lion", 1, False, "FusedLion"), ("Lion", 2, False, "FusedLion"),
         ("Lion", 3, False, "FusedLion"), ("Lion", 1, True, "DeepSpeedCPULion"), ("Lion", 2, True, "DeepSpeedCPULion"),
         ("Lion", 3, True, "DeepSpeedCPULion"), ("Adagrad", 2, True, "DeepSpeedCPUAdagrad"),
         ("Adagrad", 3, True, "DeepSpeedCPUAdagrad"), ("Adagrad", 2, False, "Adagrad")]


def _mlp(widths, seed):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _batches(widths, world, seed):
    gen = torch.Generator().manual_seed(seed + 100)
    return [(torch.randn(world * MICRO, widths[0], generator=gen), torch.randn(world * MICRO,
                                                                               widths[-1],
                                                                               generator=gen)) for _ in range(STEPS)]


def _reference(kind, widths, world, seed):
    """Plain torch on the global batches, clipped as the engine clips: torch's Adagrad, or the reference Lion
    written above."""
    model = _mlp(widths, seed)
    params = list(model.parameters())
    if kind == "Adagrad":
        optimizer = torch.optim.Adagrad(params, lr=LR, weight_decay=WD)
    else:
        lion = ReferenceLion(params, LR, BETAS, WD)
    for x, y in _batches(widths, world, seed):
        model.zero_grad()
        # each rank's loss is the mean over its micro-batch; the engine averages the ranks' gradients
        loss = sum(
            torch.nn.functional.mse_loss(model(x[r * MICRO:(r + 1) * MICRO]), y[r * MICRO:(r + 1) * MICRO])
            for r in range(world)) / world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)  # same coefficient as the engine: CLIP / (norm + 1e-6)
        if kind == "Adagrad":
            optimizer.step()
        else:
            with torch.no_grad():
                for p, value in zip(params, lion.step([p.grad for p in params])):
                    p.copy_(value)
    return [p.detach().clone() for p in params]


def _engine_cells(widths, seed):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    for kind, stage, offload, expected_class in CELLS:
        params = {"lr": LR, "weight_decay": WD}
        if kind == "Lion":
            params["betas"] = list(BETAS)
        zero = {"stage": stage}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=10)
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {
                "type": kind,
                "params": params
            },
            "zero_optimization": zero,
            "gradient_clipping": CLIP,
        }
        model = _mlp(widths, seed)
        engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config)
        inner = getattr(optimizer, "optimizer", optimizer)
        if type(inner).__name__ != expected_class:
            failures.append(f"{kind} stage {stage} offload {offload}: steps with {type(inner).__name__}")
        for x, y in _batches(widths, world, seed):
            xs, ys = x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]
            loss = torch.nn.functional.mse_loss(engine(xs), ys)
            engine.backward(loss)
            engine.step()
        got = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
        for i, (g, e) in enumerate(zip(got, _reference(kind, widths, world, seed))):
            if not torch.allclose(g, e, rtol=1e-5, atol=1e-6):
                failures.append(f"{kind} stage {stage} offload {offload}: parameter {i} off by "
                                f"{(g - e).abs().max().item():.3g}")
        engine.destroy()
    return failures


@pytest.mark.parametrize("widths,seed", [((5, 7, 1, 3), 0), ((3, 1, 9), 4)])
def test_engine_trains_with_lion_and_host_adagrad(widths, seed):
    for failures in run_distributed(_engine_cells, 2, args=(widths, seed), timeout=240):
        assert not failures, failures
