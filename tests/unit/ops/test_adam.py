# SPDX-License-Identifier: Apache-2.0
"""FusedAdam and DeepSpeedCPUAdam against Adam/AdamW written out in plain float64 tensor maths."""

import math

import pytest
import torch

from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.ops.lamb import FusedLamb

DEVICES = ['cpu'] + (['cuda'] if torch.cuda.is_available() else [])
SHAPES = [(7, 5), (13, ), (3, 4, 2)]


def reference_adam(param, grads, lr, betas, eps, weight_decay, amsgrad, decoupled):
    """Adam (L2 weight decay folded into the gradient) or AdamW (decoupled decay), float64."""
    beta1, beta2 = betas
    p = param.detach().double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    v_max = torch.zeros_like(p)
    for t, grad in enumerate(grads, start=1):
        g = grad.double()
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        if amsgrad:
            v_max = torch.maximum(v_max, v)
        second = v_max if amsgrad else v
        m_hat = m / (1 - beta1**t)
        v_hat = second / (1 - beta2**t)
        p = p - lr * m_hat / (v_hat.sqrt() + eps)
    return p


def make_problem(device, dtype=torch.float32, steps=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype)) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in SHAPES] for _ in range(steps)]
    return params, grads


def run(optimizer, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()


def build(kind, params, decoupled, **kwargs):
    if kind == 'fused_adam':
        return FusedAdam(params, adam_w_mode=decoupled, **kwargs)
    return DeepSpeedCPUAdam(params, adamw_mode=decoupled, **kwargs)


def force_kernel(optimizer, kernel):
    """Pin every group to one kernel: 'fused' or 'foreach'."""
    for group in optimizer.param_groups:
        group['fused'] = kernel == 'fused'
        group['foreach'] = kernel == 'foreach'


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('kernel', ['fused', 'foreach'])
@pytest.mark.parametrize('kind', ['fused_adam', 'cpu_adam'])
@pytest.mark.parametrize('decoupled', [True, False])
@pytest.mark.parametrize('amsgrad', [False, True])
def test_matches_reference(device, kernel, kind, decoupled, amsgrad):
    hyper = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, amsgrad=amsgrad)
    params, grads = make_problem(device)
    initial = [p.detach().clone() for p in params]
    optimizer = build(kind, params, decoupled, **hyper)
    force_kernel(optimizer, kernel)
    run(optimizer, params, grads)
    for i, p in enumerate(params):
        expected = reference_adam(initial[i], [g[i] for g in grads], decoupled=decoupled, **hyper)
        torch.testing.assert_close(p.detach().double().cpu(), expected.cpu(), rtol=1e-5, atol=1e-6)


def test_adam_and_adamw_differ():
    """Guards the reference itself: with weight decay the two modes must give different results."""
    params, grads = make_problem('cpu')
    hyper = dict(lr=3e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.5, amsgrad=False)
    adam = reference_adam(params[0], [g[0] for g in grads], decoupled=False, **hyper)
    adamw = reference_adam(params[0], [g[0] for g in grads], decoupled=True, **hyper)
    assert (adam - adamw).abs().max() > 1e-4


@pytest.mark.parametrize('device', DEVICES)
def test_default_kernel_choice(device):
    params, _ = make_problem(device)
    optimizer = FusedAdam(params)
    group = optimizer.param_groups[0]
    if device == 'cuda':
        assert group['fused'] is True
    assert group['fused'] != group['foreach']
    meta = FusedAdam([torch.nn.Parameter(torch.zeros(2, device='meta'))])
    assert meta.param_groups[0]['fused'] is False and meta.param_groups[0]['foreach'] is True


def test_torch_optimizer_surface():
    params, grads = make_problem('cpu')
    optimizer = FusedAdam(params, lr=0.01, weight_decay=0.2)
    assert isinstance(optimizer, torch.optim.Optimizer)
    group = optimizer.param_groups[0]
    assert (group['lr'], group['weight_decay'], group['bias_correction']) == (0.01, 0.2, True)
    assert group['decoupled_weight_decay'] is True
    run(optimizer, params, grads[:1])
    assert set(optimizer.state[params[0]]) == {'step', 'exp_avg', 'exp_avg_sq'}
    assert float(optimizer.state[params[0]]['step']) == 1.0
    assert set(optimizer.state_dict()) == {'state', 'param_groups'}


@pytest.mark.parametrize('kind', ['fused_adam', 'cpu_adam'])
@pytest.mark.parametrize('amsgrad', [False, True])
def test_state_dict_round_trip(kind, amsgrad):
    hyper = dict(lr=2e-2, weight_decay=0.05, amsgrad=amsgrad)
    params_a, grads = make_problem('cpu', steps=6)
    params_b = [torch.nn.Parameter(p.detach().clone()) for p in params_a]
    straight = build(kind, params_a, True, **hyper)
    run(straight, params_a, grads)

    first = build(kind, params_b, True, **hyper)
    run(first, params_b, grads[:3])
    saved = first.state_dict()
    params_c = [torch.nn.Parameter(p.detach().clone()) for p in params_b]
    resumed = build(kind, params_c, True, lr=0.5)  # hyperparameters come back from the state dict
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]['lr'] == hyper['lr']
    run(resumed, params_c, grads[3:])
    for a, c in zip(params_a, params_c):
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_loads_state_with_step_in_group():
    """A state dict whose step count lives in the group (upstream FusedAdam's layout) resumes exactly."""
    params_a, grads = make_problem('cpu', steps=5)
    params_b = [torch.nn.Parameter(p.detach().clone()) for p in params_a]
    straight = FusedAdam(params_a, lr=1e-2)
    run(straight, params_a, grads)

    first = FusedAdam(params_b, lr=1e-2)
    run(first, params_b, grads[:2])
    saved = first.state_dict()
    legacy_state = {}
    for pid, st in saved['state'].items():
        legacy_state[pid] = {k: v for k, v in st.items() if k != 'step'}
    legacy_groups = [{
        'params': g['params'],
        'lr': g['lr'],
        'bias_correction': True,
        'betas': g['betas'],
        'eps': g['eps'],
        'weight_decay': g['weight_decay'],
        'step': 2,
    } for g in saved['param_groups']]
    params_c = [torch.nn.Parameter(p.detach().clone()) for p in params_b]
    resumed = FusedAdam(params_c, lr=1e-2)
    resumed.load_state_dict({'state': legacy_state, 'param_groups': legacy_groups})
    run(resumed, params_c, grads[2:])
    for a, c in zip(params_a, params_c):
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_param_groups_keep_their_hyperparameters():
    params, grads = make_problem('cpu')
    initial = [p.detach().clone() for p in params]
    groups = [{'params': params[:1], 'lr': 0.1, 'weight_decay': 0.0}, {'params': params[1:], 'weight_decay': 0.3}]
    optimizer = FusedAdam(groups, lr=1e-2, adam_w_mode=False)
    run(optimizer, params, grads)
    expected = [
        reference_adam(initial[0], [g[0] for g in grads], 0.1, (0.9, 0.999), 1e-8, 0.0, False, False),
    ] + [
        reference_adam(initial[i], [g[i] for g in grads], 1e-2, (0.9, 0.999), 1e-8, 0.3, False, False) for i in (1, 2)
    ]
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-6)


def test_params_without_grad_are_untouched():
    params, grads = make_problem('cpu', steps=2)
    before = params[1].detach().clone()
    optimizer = FusedAdam(params, weight_decay=0.1)
    for step_grads in grads:
        params[0].grad, params[2].grad = step_grads[0], step_grads[2]
        optimizer.step()
    assert torch.equal(params[1], before)
    assert len(optimizer.state[params[1]]) == 0


def test_bias_correction_false_is_refused():
    params, _ = make_problem('cpu')
    for ctor in (FusedAdam, DeepSpeedCPUAdam):
        with pytest.raises(NotImplementedError, match='bias_correction'):
            ctor(params, bias_correction=False)
    optimizer = FusedAdam(params)
    optimizer.param_groups[0]['bias_correction'] = False
    params[0].grad = torch.ones_like(params[0])
    with pytest.raises(NotImplementedError, match='bias_correction'):
        optimizer.step()


@pytest.mark.parametrize('set_grad_none', [True, False])
def test_zero_grad_follows_set_grad_none(set_grad_none):
    params, _ = make_problem('cpu')
    optimizer = FusedAdam(params, set_grad_none=set_grad_none)
    params[0].grad = torch.ones_like(params[0])
    optimizer.zero_grad()
    if set_grad_none:
        assert params[0].grad is None
    else:
        assert torch.equal(params[0].grad, torch.zeros_like(params[0]))
    params[0].grad = torch.ones_like(params[0])
    optimizer.zero_grad(set_to_none=not set_grad_none)
    assert (params[0].grad is None) == (not set_grad_none)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_cpu_adam_low_precision_params_keep_fp32_states(dtype):
    """Each step: widen param and grad to fp32, update with fp32 moments, round the param back."""
    params, grads = make_problem('cpu', dtype=dtype, steps=3)
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    expected = [p.detach().clone() for p in params]
    ref_moments = [(torch.zeros(p.shape), torch.zeros(p.shape)) for p in params]
    optimizer = DeepSpeedCPUAdam(params, **hyper)
    for t, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(step_grads):
            p32, g32 = expected[i].float(), g.float()
            m, v = ref_moments[i]
            p32 = p32 * (1 - hyper['lr'] * hyper['weight_decay'])
            m = 0.9 * m + 0.1 * g32
            v = 0.999 * v + 0.001 * g32 * g32
            ref_moments[i] = (m, v)
            denom = (v / (1 - 0.999**t)).sqrt() + hyper['eps']
            expected[i] = (p32 - hyper['lr'] * (m / (1 - 0.9**t)) / denom).to(dtype)
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
    for i, p in enumerate(params):
        assert p.dtype == dtype
        assert optimizer.state[p]['exp_avg'].dtype == torch.float32
        torch.testing.assert_close(optimizer.state[p]['exp_avg'], ref_moments[i][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p.detach().float(),
                                   expected[i].float(),
                                   rtol=0,
                                   atol=2 * float(p.detach().abs().max()) * torch.finfo(dtype).eps)

    # A checkpoint round trip keeps the fp32 moments unrounded.
    saved = optimizer.state_dict()
    resumed = DeepSpeedCPUAdam([torch.nn.Parameter(p.detach().clone()) for p in params], **hyper)
    resumed.load_state_dict(saved)
    for p_old, p_new in zip(params, resumed.param_groups[0]['params']):
        assert torch.equal(resumed.state[p_new]['exp_avg_sq'], optimizer.state[p_old]['exp_avg_sq'])


def test_cpu_adam_low_precision_states_when_asked():
    params, grads = make_problem('cpu', dtype=torch.bfloat16, steps=1)
    optimizer = DeepSpeedCPUAdam(params, fp32_optimizer_states=False)
    run(optimizer, params, grads)
    assert optimizer.state[params[0]]['exp_avg'].dtype == torch.bfloat16


@pytest.mark.parametrize('layout', ['nested', 'flat'])
def test_cpu_adam_copies_into_fp16_param_groups(layout):
    params, grads = make_problem('cpu', steps=1)
    copies = [torch.zeros_like(p, dtype=torch.float16) for p in params]
    optimizer = DeepSpeedCPUAdam(params)
    params[1].grad = None
    params[0].grad, params[2].grad = grads[0][0], grads[0][2]
    optimizer.step(fp16_param_groups=[copies] if layout == 'nested' else copies)
    assert torch.equal(copies[0], params[0].detach().half())
    assert torch.equal(copies[2], params[2].detach().half())
    assert torch.equal(copies[1], torch.zeros_like(copies[1]))  # not stepped, not copied


def test_step_closure_returns_loss():
    params, _ = make_problem('cpu')
    optimizer = FusedAdam(params, lr=0.1)

    def closure():
        optimizer.zero_grad()
        loss = sum((p**2).sum() for p in params)
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert math.isfinite(float(loss.detach()))
    assert float(optimizer.state[params[0]]['step']) == 1.0


def test_lamb_is_not_implemented():
    with pytest.raises(NotImplementedError, match='compatibility.md'):
        FusedLamb([torch.nn.Parameter(torch.zeros(2))])
    assert issubclass(FusedLamb, torch.optim.Optimizer)
