# SPDX-License-Identifier: Apache-2.0
"""Build the optimizer named by the config's ``optimizer.type`` with ``optimizer.params``.

Names follow upstream (case-insensitive):

==============  ============================================================================
``adam``        :class:`~deepspeed.ops.adam.FusedAdam`; AdamW maths unless ``adam_w_mode``
                is false in the params (then Adam with L2 weight decay)
``adamw``       :class:`~deepspeed.ops.adam.FusedAdam` with AdamW maths (``adam_w_mode``
                cannot turn it off)
``sgd``         ``torch.optim.SGD``
``adagrad``     ``torch.optim.Adagrad``; :class:`~deepspeed.ops.adagrad.DeepSpeedCPUAdagrad` with
                ``cpu_optimizer=True``
``lion``        :class:`~deepspeed.ops.lion.FusedLion`; :class:`~deepspeed.ops.lion.DeepSpeedCPULion`
                with ``cpu_optimizer=True``
``muon``        :class:`~deepspeed.ops.muon.MuonWithAuxAdam` over the parameters' ``use_muon``
                split (:mod:`deepspeed.ops.muon.param_split`); its Adam half is FusedAdam,
                DeepSpeedCPUAdam with ``cpu_optimizer=True``, torch's with ``torch_adam``
==============  ============================================================================

For ``adam``/``adamw``, ``torch_adam: true`` selects ``torch.optim.Adam`` / ``torch.optim.AdamW``
instead, and ``cpu_optimizer=True`` (optimizer offload) selects
:class:`~deepspeed.ops.adam.DeepSpeedCPUAdam`. The config-only keys ``torch_adam`` and
``adam_w_mode`` are removed before the params reach a constructor. Any other name that is a
``torch.optim`` optimizer class (``"RMSprop"``, ``"NAdam"``...) builds that class, as upstream
does. DeepSpeed's own optimizers that are not implemented here (``lamb``, the 1-bit and 0/1
optimizers, the ``mu*`` family) raise NotImplementedError.
"""

import inspect

import torch

from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

ADAGRAD_OPTIMIZER = 'adagrad'
ADAM_OPTIMIZER = 'adam'
ADAMW_OPTIMIZER = 'adamw'
SGD_OPTIMIZER = 'sgd'
LAMB_OPTIMIZER = 'lamb'
ONEBIT_ADAM_OPTIMIZER = 'onebitadam'
ZERO_ONE_ADAM_OPTIMIZER = 'zerooneadam'
ONEBIT_LAMB_OPTIMIZER = 'onebitlamb'
MUADAM_OPTIMIZER = 'muadam'
MUADAMW_OPTIMIZER = 'muadamw'
MUSGD_OPTIMIZER = 'musgd'
LION_OPTIMIZER = 'lion'
MUON_OPTIMIZER = 'muon'

UNSUPPORTED_OPTIMIZERS = (LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER,
                          MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER)

# Config-only keys of the adam/adamw params.
TORCH_ADAM_PARAM = 'torch_adam'
ADAM_W_MODE = 'adam_w_mode'
ADAM_W_MODE_DEFAULT = True

_TORCH_CLASSES = {SGD_OPTIMIZER: torch.optim.SGD, ADAGRAD_OPTIMIZER: torch.optim.Adagrad}


def build_optimizer(name, params, optimizer_params=None, device_type=None, cpu_optimizer=False):
    """Return a new optimizer over ``params`` (tensors or param-group dicts).

    Args:
        name: the config's ``optimizer.type``.
        params: what the optimizer updates, as for any ``torch.optim`` constructor.
        optimizer_params: the config's ``optimizer.params``; not modified.
        device_type: where the parameters are stepped (``"cuda"``, ``"cpu"``...). On a
            non-CPU device, torch optimizers other than Adam get ``foreach=True`` unless the
            params choose ``foreach``/``fused`` themselves.
        cpu_optimizer: optimizer states are offloaded; ``adam``/``adamw``, ``adagrad`` and ``lion``
            build the host optimizers (:class:`DeepSpeedCPUAdam`, :class:`DeepSpeedCPUAdagrad`,
            :class:`DeepSpeedCPULion`).

    Raises:
        ValueError: unknown name, ``max_grad_norm`` in the params (use ``gradient_clipping``),
            or a parameter still set to ``"auto"``.
        NotImplementedError: a DeepSpeed optimizer this runtime does not provide.
    """
    if not isinstance(name, str):
        raise ValueError(f'optimizer.type must be a string, got {name!r}')
    kwargs = dict(optimizer_params or {})
    _check_params(kwargs)
    key = name.lower()

    if key in UNSUPPORTED_OPTIMIZERS:
        raise NotImplementedError(
            f'optimizer type {name!r} is not implemented by this DeepSpeed runtime; it is listed '
            'as unsupported in docs/compatibility.md. Use "Adam", "AdamW", "SGD", "Adagrad", "Lion", '
            'another torch.optim class name, or pass an optimizer instance to initialize().')
    if key in (ADAM_OPTIMIZER, ADAMW_OPTIMIZER):
        return _build_adam(key, params, kwargs, cpu_optimizer)
    if key == LION_OPTIMIZER:
        return (DeepSpeedCPULion if cpu_optimizer else FusedLion)(params, **kwargs)
    if key == MUON_OPTIMIZER:
        return _build_muon(params, kwargs, cpu_optimizer)
    if key == ADAGRAD_OPTIMIZER:
        # Upstream also accepts the adam-only keys here; they do not apply to Adagrad.
        kwargs.pop(TORCH_ADAM_PARAM, None)
        kwargs.pop(ADAM_W_MODE, None)
        if cpu_optimizer:
            return DeepSpeedCPUAdagrad(params, **kwargs)

    torch_class = _TORCH_CLASSES.get(key) or _torch_optimizer_class(name)
    if torch_class is None:
        raise ValueError(f'Unknown optimizer type {name!r}: expected Adam, AdamW, SGD, Adagrad, Lion or a '
                         'torch.optim optimizer class name')
    if device_type not in (None, 'cpu') and _accepts(torch_class, 'foreach'):
        if 'foreach' not in kwargs and not kwargs.get('fused'):
            kwargs['foreach'] = True
    return torch_class(params, **kwargs)


def _check_params(kwargs):
    if 'max_grad_norm' in kwargs:
        raise ValueError("'max_grad_norm' is not supported as an optimizer parameter; use the top-level "
                         "'gradient_clipping' config key instead")
    for key, value in kwargs.items():
        if isinstance(value, str) and value == 'auto':
            raise ValueError(f'optimizer.params.{key} is "auto"; the launching framework must replace "auto" with '
                             'a value before the config reaches DeepSpeed')


def _build_adam(key, params, kwargs, cpu_optimizer):
    torch_adam = kwargs.pop(TORCH_ADAM_PARAM, False)
    adam_w_mode = kwargs.pop(ADAM_W_MODE, ADAM_W_MODE_DEFAULT)
    # The name "AdamW" always means decoupled weight decay; "Adam" means it unless opted out.
    decoupled = key == ADAMW_OPTIMIZER or bool(adam_w_mode)
    if torch_adam:
        return (torch.optim.AdamW if decoupled else torch.optim.Adam)(params, **kwargs)
    if cpu_optimizer:
        return DeepSpeedCPUAdam(params, **kwargs, adamw_mode=decoupled)
    return FusedAdam(params, **kwargs, adam_w_mode=decoupled)


def _build_muon(params, kwargs, cpu_optimizer):
    """Muon on the parameters marked ``use_muon``, an Adam on the others (upstream's defaults and keys)."""
    from deepspeed.ops.muon import MuonWithAuxAdam
    from deepspeed.ops.muon.param_split import check_muon_config, muon_param_groups
    check_muon_config(kwargs)
    adam_w_mode = bool(kwargs.get(ADAM_W_MODE, ADAM_W_MODE_DEFAULT))
    if kwargs.get(TORCH_ADAM_PARAM, False):
        adam, adam_kwargs = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam), {}
    elif cpu_optimizer:
        adam, adam_kwargs = DeepSpeedCPUAdam, dict(adamw_mode=adam_w_mode)
    else:
        adam, adam_kwargs = FusedAdam, dict(adam_w_mode=adam_w_mode)
    return MuonWithAuxAdam(muon_param_groups(list(params), kwargs),
                           adam_optimizer=adam,
                           adam_optimizer_kwargs=adam_kwargs,
                           adam_w_mode=adam_w_mode)


def _torch_optimizer_class(name):
    """The ``torch.optim`` optimizer class called ``name`` (exact, else case-insensitive), or None."""
    exact = getattr(torch.optim, name, None)
    if _is_optimizer_class(exact):
        return exact
    for attr in dir(torch.optim):
        if attr.lower() == name.lower() and _is_optimizer_class(getattr(torch.optim, attr)):
            return getattr(torch.optim, attr)
    return None


def _is_optimizer_class(obj):
    return isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer


def _accepts(cls, argument):
    try:
        return argument in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


# Upstream's message names the config key that allows a client optimizer with optimizer offload.
_CLIENT_OFFLOAD_OPTIMIZER = (
    "You are using ZeRO-Offload with a client provided optimizer ({name}), which steps the offloaded states with "
    "torch's CPU kernels. Use deepspeed.ops.adam.DeepSpeedCPUAdam (or DeepSpeedCPULion), or set an optimizer in the "
    "config's \"optimizer\" section; to keep this optimizer, set \"zero_force_ds_cpu_optimizer\": false.")


def check_client_offload_optimizer(optimizer, offload_device, force_ds_cpu_optimizer):
    """Upstream's ``zero_force_ds_cpu_optimizer`` (default true): with optimizer offload (``cpu``/``nvme``), a
    client optimizer other than ``DeepSpeedCPUAdam`` / ``DeepSpeedCPULion`` raises ``ZeRORuntimeException``
    (every rank: the same config and optimizer type), unless the key is false."""
    if offload_device not in ("cpu", "nvme") or not force_ds_cpu_optimizer:
        return
    if isinstance(optimizer, (DeepSpeedCPUAdam, DeepSpeedCPULion)):
        return
    from deepspeed.runtime.zero.utils import ZeRORuntimeException
    raise ZeRORuntimeException(_CLIENT_OFFLOAD_OPTIMIZER.format(name=type(optimizer).__name__))
