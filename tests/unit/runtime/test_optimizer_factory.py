# SPDX-License-Identifier: Apache-2.0
"""build_optimizer: config optimizer.type names map to the expected class and hyperparameters."""

import pytest
import torch

from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
from deepspeed.runtime.engine_parts.optimizer_factory import UNSUPPORTED_OPTIMIZERS, build_optimizer


def params():
    return [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(2))]


ADAM_PARAMS = {'lr': 3e-4, 'betas': [0.8, 0.99], 'eps': 1e-6, 'weight_decay': 0.01}

# (type, extra params, cpu_optimizer) -> (class, decoupled weight decay)
ADAM_CASES = [
    ('Adam', {}, False, FusedAdam, True),
    ('adam', {
        'adam_w_mode': False
    }, False, FusedAdam, False),
    ('ADAMW', {}, False, FusedAdam, True),
    ('AdamW', {
        'adam_w_mode': False
    }, False, FusedAdam, True),
    ('Adam', {}, True, DeepSpeedCPUAdam, True),
    ('Adam', {
        'adam_w_mode': False
    }, True, DeepSpeedCPUAdam, False),
    ('AdamW', {}, True, DeepSpeedCPUAdam, True),
    ('Adam', {
        'torch_adam': True
    }, False, torch.optim.AdamW, True),
    ('Adam', {
        'torch_adam': True,
        'adam_w_mode': False
    }, False, torch.optim.Adam, False),
    ('AdamW', {
        'torch_adam': True,
        'adam_w_mode': False
    }, True, torch.optim.AdamW, True),
]


@pytest.mark.parametrize('name,extra,cpu_optimizer,cls,decoupled', ADAM_CASES)
def test_adam_family(name, extra, cpu_optimizer, cls, decoupled):
    config = {**ADAM_PARAMS, **extra}
    snapshot = dict(config)
    optimizer = build_optimizer(name, params(), config, device_type='cpu', cpu_optimizer=cpu_optimizer)
    assert type(optimizer) is cls
    assert config == snapshot, 'the config dict must not be modified'
    group = optimizer.param_groups[0]
    assert group['lr'] == 3e-4 and tuple(group['betas']) == (0.8, 0.99)
    assert group['eps'] == 1e-6 and group['weight_decay'] == 0.01
    assert 'torch_adam' not in group and 'adam_w_mode' not in group
    assert group['decoupled_weight_decay'] is decoupled
    if cls is FusedAdam:
        assert optimizer.adam_w_mode == int(decoupled)
    if cls is DeepSpeedCPUAdam:
        assert optimizer.adam_w_mode == decoupled


def test_adam_defaults_match_fused_adam():
    optimizer = build_optimizer('adam', params(), None, device_type='cpu')
    group = optimizer.param_groups[0]
    assert (group['lr'], group['betas'], group['eps'], group['weight_decay']) == (1e-3, (0.9, 0.999), 1e-8, 0.0)


@pytest.mark.parametrize('device_type,foreach', [('cpu', None), ('cuda', True)])
def test_sgd(device_type, foreach):
    optimizer = build_optimizer('SGD', params(), {'lr': 0.1, 'momentum': 0.9, 'nesterov': True}, device_type)
    assert type(optimizer) is torch.optim.SGD
    group = optimizer.param_groups[0]
    assert (group['lr'], group['momentum'], group['nesterov'], group['foreach']) == (0.1, 0.9, True, foreach)


def test_sgd_keeps_explicit_kernel_choice():
    optimizer = build_optimizer('sgd', params(), {'lr': 0.1, 'foreach': False}, 'cuda')
    assert optimizer.param_groups[0]['foreach'] is False


def test_adagrad():
    config = {'lr': 0.05, 'lr_decay': 0.01, 'torch_adam': False}
    optimizer = build_optimizer('Adagrad', params(), config, 'cpu')
    assert type(optimizer) is torch.optim.Adagrad
    assert (optimizer.param_groups[0]['lr'], optimizer.param_groups[0]['lr_decay']) == (0.05, 0.01)
    # optimizer offload: the host Adagrad, as upstream (its constructor has no lr_decay)
    optimizer = build_optimizer('adagrad', params(), {'lr': 0.05, 'eps': 1e-8}, 'cpu', cpu_optimizer=True)
    assert type(optimizer) is DeepSpeedCPUAdagrad
    assert (optimizer.param_groups[0]['lr'], optimizer.param_groups[0]['eps']) == (0.05, 1e-8)
    with pytest.raises(TypeError, match='lr_decay'):
        build_optimizer('Adagrad', params(), config, 'cpu', cpu_optimizer=True)


@pytest.mark.parametrize('cpu_optimizer,cls', [(False, FusedLion), (True, DeepSpeedCPULion)])
def test_lion(cpu_optimizer, cls):
    config = {'lr': 2e-4, 'betas': [0.8, 0.95], 'weight_decay': 0.1}
    optimizer = build_optimizer('Lion', params(), config, 'cuda', cpu_optimizer=cpu_optimizer)
    assert type(optimizer) is cls
    group = optimizer.param_groups[0]
    assert (group['lr'], tuple(group['betas']), group['weight_decay']) == (2e-4, (0.8, 0.95), 0.1)


@pytest.mark.parametrize('name', ['RMSprop', 'rmsprop', 'NAdam'])
def test_other_torch_optimizers(name):
    optimizer = build_optimizer(name, params(), {'lr': 0.02}, 'cpu')
    assert type(optimizer).__name__.lower() == name.lower()
    assert optimizer.param_groups[0]['lr'] == 0.02


def test_param_groups_pass_through():
    p = params()
    groups = [{'params': [p[0]], 'lr': 0.5}, {'params': [p[1]]}]
    optimizer = build_optimizer('AdamW', groups, {'lr': 0.1}, 'cpu')
    assert [g['lr'] for g in optimizer.param_groups] == [0.5, 0.1]


@pytest.mark.parametrize('name', sorted(UNSUPPORTED_OPTIMIZERS) + ['OneBitAdam', 'Lamb'])
def test_unsupported_types_raise(name):
    with pytest.raises(NotImplementedError) as info:
        build_optimizer(name, params(), {'lr': 0.1}, 'cpu')
    assert repr(name) in str(info.value) and 'docs/compatibility.md' in str(info.value)


def test_unknown_and_invalid():
    with pytest.raises(ValueError, match='Unknown optimizer type'):
        build_optimizer('NoSuchOptimizer', params(), {}, 'cpu')
    with pytest.raises(ValueError, match='gradient_clipping'):
        build_optimizer('Adam', params(), {'lr': 0.1, 'max_grad_norm': 1.0}, 'cpu')
    with pytest.raises(ValueError, match='optimizer.params.lr'):
        build_optimizer('AdamW', params(), {'lr': 'auto'}, 'cpu')


def test_client_optimizer_with_offload_needs_the_ds_cpu_optimizer():
    """Upstream's zero_force_ds_cpu_optimizer (default true): a client optimizer other than DeepSpeedCPUAdam /
    DeepSpeedCPULion with optimizer offload raises ZeRORuntimeException, unless the key is false."""
    from deepspeed.runtime.engine_parts.optimizer_factory import check_client_offload_optimizer
    from deepspeed.runtime.zero.utils import ZeRORuntimeException
    adam = torch.optim.Adam(params())
    for device in ("cpu", "nvme"):
        with pytest.raises(ZeRORuntimeException, match='"zero_force_ds_cpu_optimizer": false'):
            check_client_offload_optimizer(adam, device, True)
    check_client_offload_optimizer(adam, "cpu", False)
    check_client_offload_optimizer(adam, "none", True)
    check_client_offload_optimizer(DeepSpeedCPUAdam(params()), "cpu", True)
    check_client_offload_optimizer(DeepSpeedCPULion(params()), "nvme", True)
    with pytest.raises(ZeRORuntimeException):
        check_client_offload_optimizer(DeepSpeedCPUAdagrad(params()), "cpu", True)  # as upstream


def _initialize_with_client_optimizer(force, client):
    import deepspeed
    model = torch.nn.Linear(3, 2)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {
                "device": "cpu"
            }
        }
    }
    if force is not None:
        config["zero_force_ds_cpu_optimizer"] = force
    optimizer = torch.optim.Adam(model.parameters()) if client == "instance" else (lambda p: torch.optim.SGD(p, 0.1))
    try:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    except Exception as exc:  # noqa: BLE001 -- the type is the assertion
        return type(exc).__name__
    engine.destroy()
    return "ok"


@pytest.mark.parametrize("force,client,expected", [(None, "instance", "ZeRORuntimeException"),
                                                   (None, "callable", "ZeRORuntimeException"),
                                                   (False, "instance", "ok")])
def test_initialize_refuses_client_optimizer_with_offload(force, client, expected):
    from tests.unit.common import run_distributed
    assert run_distributed(_initialize_with_client_optimizer, 2, args=(force, client), timeout=60) == [expected] * 2
