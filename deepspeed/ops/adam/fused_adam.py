# SPDX-License-Identifier: Apache-2.0
"""``FusedAdam``: Adam / AdamW on torch's own fused or multi-tensor (foreach) kernels.

:class:`TorchKernelAdam` is the shared machinery (also used by
:class:`~deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam`): a ``torch.optim.Adam`` subclass
whose ``step`` calls torch's functional ``adam`` with a kernel chosen per parameter group:

- ``fused=True`` when every parameter of the group is a floating-point tensor on a device
  type whose fused Adam kernel works for that dtype (CUDA always; CPU where the installed
  torch build has the fused CPU kernel, found by running it once on a tiny tensor);
- ``foreach=True`` otherwise.

The choice is made when a group is added and again after ``load_state_dict``; it is kept in
the group's ``fused`` / ``foreach`` keys, as torch keeps it. ``param_groups``, ``state``
(``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) and ``state_dict()`` have
torch's layout, plus a ``bias_correction`` key per group (upstream's group key). Loading an
upstream FusedAdam state dict, which keeps the step count in the group, also works.

Maths: adam_w_mode selects decoupled weight decay (AdamW) over L2 added to the gradient
(Adam), through torch's ``decoupled_weight_decay``. ``amsgrad`` is torch's. Torch's kernels
always apply bias correction, so ``bias_correction=False`` raises NotImplementedError.
"""

import torch
from torch.optim.adam import adam as _functional_adam

# Device types torch ships fused Adam kernels for; each (type, dtype) pair is confirmed by a probe.
_FUSED_DEVICE_TYPES = ('cuda', 'cpu', 'xpu', 'mps', 'hpu')
_fused_available = {}

_NO_BIAS_CORRECTION = ('bias_correction=False is not supported: this Adam runs on torch\'s kernels, which always '
                       'apply bias correction')


def _probe_fused(device, dtype):
    """Run the fused Adam kernel once on a one-element tensor; True if it works."""
    try:
        with torch.no_grad():
            param = torch.zeros(1, device=device, dtype=dtype)
            _functional_adam([param], [torch.ones_like(param)], [torch.zeros_like(param)], [torch.zeros_like(param)],
                             [], [torch.zeros((), dtype=torch.float32, device=device)],
                             fused=True,
                             decoupled_weight_decay=True,
                             amsgrad=False,
                             beta1=0.9,
                             beta2=0.999,
                             lr=1e-3,
                             weight_decay=0.0,
                             eps=1e-8,
                             maximize=False)
        return True
    except Exception:  # any failure means "use foreach"; the probe must never break construction
        return False


def fused_kernel_available(device, dtype):
    """Whether torch's fused Adam kernel runs for tensors of ``dtype`` on ``device`` (cached per type)."""
    device = torch.device(device)
    key = (device.type, dtype)
    if key not in _fused_available:
        _fused_available[key] = (device.type in _FUSED_DEVICE_TYPES and dtype.is_floating_point
                                 and _probe_fused(device, dtype))
    return _fused_available[key]


def _use_fused(params):
    return bool(params) and all(fused_kernel_available(p.device, p.dtype) for p in params)


def _scalar_dtype():
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class TorchKernelAdam(torch.optim.Adam):
    """Adam/AdamW whose step runs torch's fused or foreach kernel, chosen per param group.

    A ``torch.optim.Adam`` (so ``isinstance(opt, torch.optim.Optimizer)`` holds) whose groups
    carry torch's keys plus ``bias_correction``. Subclasses set the public constructor.
    """

    def __init__(self, params, lr, bias_correction, betas, eps, weight_decay, amsgrad, decoupled_weight_decay):
        if not bias_correction:
            raise NotImplementedError(_NO_BIAS_CORRECTION)
        betas = tuple(b if torch.is_tensor(b) else float(b) for b in betas)
        super().__init__(params,
                         lr=lr,
                         betas=betas,
                         eps=eps,
                         weight_decay=weight_decay,
                         amsgrad=amsgrad,
                         decoupled_weight_decay=bool(decoupled_weight_decay))
        self.defaults['bias_correction'] = True

    # -- groups --------------------------------------------------------------------------------

    def add_param_group(self, param_group):
        """torch's add_param_group, then pick the group's kernel from where its params live."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group.setdefault('bias_correction', True)
        self._choose_kernel(group)

    @staticmethod
    def _choose_kernel(group):
        fused = _use_fused(group['params'])
        group['fused'] = fused
        group['foreach'] = not fused

    # -- step ----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam step for every parameter that has a gradient; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group.get('bias_correction', True):
                raise NotImplementedError(_NO_BIAS_CORRECTION)
            params, grads = [], []
            for p in group['params']:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f'{type(self).__name__} does not support sparse gradients')
                params.append(p)
                grads.append(p.grad)
            if params:
                self._step_group(group, params, grads)
        return loss

    def _step_group(self, group, params, grads):
        """Update ``params`` (those of ``group`` with a gradient). Subclasses may split the list."""
        self._adam(group, params, grads, params)

    def _adam(self, group, params, grads, owners):
        """Run torch's Adam on ``params``/``grads``; optimizer state is kept under ``owners``.

        ``owners[i]`` is the parameter whose state ``params[i]`` uses; it differs from
        ``params[i]`` only when a subclass steps a higher-precision copy.
        """
        fused = bool(group['fused'])
        exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], []
        for p, owner in zip(params, owners):
            state = self._state_for(owner, p, group)
            exp_avgs.append(state['exp_avg'])
            exp_avg_sqs.append(state['exp_avg_sq'])
            if group['amsgrad']:
                max_exp_avg_sqs.append(state['max_exp_avg_sq'])
            steps.append(state['step'])
        beta1, beta2 = group['betas']
        _functional_adam(params,
                         grads,
                         exp_avgs,
                         exp_avg_sqs,
                         max_exp_avg_sqs,
                         steps,
                         foreach=bool(group['foreach']) and not fused,
                         capturable=group['capturable'],
                         differentiable=False,
                         fused=fused,
                         has_complex=any(torch.is_complex(p) for p in params),
                         decoupled_weight_decay=group['decoupled_weight_decay'],
                         amsgrad=group['amsgrad'],
                         beta1=beta1,
                         beta2=beta2,
                         lr=group['lr'],
                         weight_decay=group['weight_decay'],
                         eps=group['eps'],
                         maximize=group['maximize'])

    def _state_for(self, owner, param, group):
        """The state of ``owner``, created lazily with moments shaped and typed like ``param``."""
        state = self.state[owner]
        on_device = group['fused'] or group['capturable']
        if len(state) == 0:
            # Fused and capturable kernels read the step count on the device; the others on the host.
            state['step'] = (torch.zeros((), dtype=torch.float32, device=param.device)
                             if on_device else torch.tensor(0.0, dtype=_scalar_dtype()))
            state['exp_avg'] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state['exp_avg_sq'] = torch.zeros_like(param, memory_format=torch.preserve_format)
        elif on_device and (state['step'].device != param.device or state['step'].dtype != torch.float32):
            state['step'] = state['step'].to(device=param.device, dtype=torch.float32)
        if group['amsgrad'] and 'max_exp_avg_sq' not in state:
            state['max_exp_avg_sq'] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    # -- checkpoints ---------------------------------------------------------------------------

    def load_state_dict(self, state_dict):
        """torch's load_state_dict; the kernel keeps following where the parameters live now.

        Keys missing from a saved group (an upstream FusedAdam checkpoint has no torch-only
        keys) take this optimizer's values, and a step count kept in the group (upstream's
        layout) becomes each parameter's ``step``.
        """
        super().load_state_dict(self._adapt_state_dict(state_dict))
        for group in self.param_groups:
            self._choose_kernel(group)

    def _adapt_state_dict(self, state_dict):
        state = dict(state_dict['state'])
        groups = []
        for saved, current in zip(state_dict['param_groups'], self.param_groups):
            group = dict(saved)
            for key, value in current.items():
                if key != 'params':
                    group.setdefault(key, value)
            # Decide the kernel before torch places each 'step' tensor according to it.
            group['fused'] = current['fused']
            group['foreach'] = current['foreach']
            if 'step' in saved:
                for param_id in saved['params']:
                    if param_id in state and 'step' not in state[param_id]:
                        state[param_id] = {**state[param_id], 'step': torch.tensor(float(saved['step']))}
            groups.append(group)
        groups.extend(state_dict['param_groups'][len(groups):])  # torch reports a count mismatch
        return {**state_dict, 'state': state, 'param_groups': groups}


class FusedAdam(TorchKernelAdam):
    """Adam (``adam_w_mode=False``) or AdamW (``adam_w_mode=True``, the default) on torch's kernels.

    Upstream's signature and defaults. ``zero_grad()`` sets gradients to None when
    ``set_grad_none`` (default) and zeroes them otherwise; an explicit ``set_to_none``
    argument wins. ``bias_correction=False`` raises NotImplementedError.
    """

    def __init__(self,
                 params,
                 lr=1e-3,
                 bias_correction=True,
                 betas=(0.9, 0.999),
                 eps=1e-8,
                 adam_w_mode=True,
                 weight_decay=0.,
                 amsgrad=False,
                 set_grad_none=True):
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        super().__init__(params,
                         lr=lr,
                         bias_correction=bias_correction,
                         betas=betas,
                         eps=eps,
                         weight_decay=weight_decay,
                         amsgrad=amsgrad,
                         decoupled_weight_decay=adam_w_mode)

    def zero_grad(self, set_to_none=None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
