# SPDX-License-Identifier: Apache-2.0
"""What the elementwise optimizers (Lion, the CPU Adagrad) share: one step over a parameter group, with the
16-bit parameters stepped through float32.

An :class:`ElementwiseOptimizer` keeps, per parameter, a ``step`` count (a Python int, as upstream's CPU
optimizers keep it) and the tensors its subclass names in ``STATE_KEYS``. ``fp32_optimizer_states=True``
keeps the state of a float16/bfloat16 parameter in float32 and computes its update on float32 copies of the
parameter and the gradient, rounded back into the parameter once; with ``False`` the state takes the
parameter's dtype and the update is computed in it. Subclasses implement :meth:`update` on lists of
same-dtype tensors (torch's foreach kernels).
"""

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


class ElementwiseOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose step is one elementwise update per parameter (see the module docstring)."""

    STATE_KEYS = ()
    # True: parameters must live on the host (the CPU optimizers); the step asserts it, as upstream's do.
    HOST_ONLY = False

    def __init__(self, params, defaults, fp32_optimizer_states=True):
        super().__init__(params, defaults)
        self.fp32_optimizer_states = fp32_optimizer_states

    def _widens(self, param):
        return self.fp32_optimizer_states and param.dtype in LOW_PRECISION

    def _state_for(self, param):
        state = self.state[param]
        dtype = torch.float32 if self._widens(param) else param.dtype
        if len(state) == 0:
            state['step'] = 0
            for key in self.STATE_KEYS:
                state[key] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
        for key in self.STATE_KEYS:  # a loaded checkpoint may hold another dtype or device
            if state[key].dtype != dtype or state[key].device != param.device:
                state[key] = state[key].to(device=param.device, dtype=dtype)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            stepped = [p for p in group['params'] if p.grad is not None]
            if self.HOST_ONLY:
                for p in stepped:
                    assert p.device.type == 'cpu', (f'{type(self).__name__} steps parameters on the host; got one on '
                                                    f'{p.device}. Use the device optimizer for device parameters.')
            dense = []
            for p in stepped:
                state = self._state_for(p)
                state['step'] += 1
                if p.grad.is_sparse:
                    self.sparse_update(group, p, p.grad, state)
                else:
                    dense.append(p)
            by_dtype = {}  # one foreach update per (device, dtype)
            for p in dense:
                by_dtype.setdefault((p.device, p.dtype), []).append(p)
            for params in by_dtype.values():
                widens = self._widens(params[0])
                work = [p.detach().float() if widens else p.detach() for p in params]
                grads = [p.grad.float() if widens else p.grad.to(p.dtype) for p in params]
                states = [self.state[p] for p in params]
                self.update(group, work, grads, [[s[k] for s in states] for k in self.STATE_KEYS])
                if widens:
                    for p, w in zip(params, work):
                        p.copy_(w)
        return loss

    def update(self, group, params, grads, state_lists):
        """Update ``params`` in place from ``grads``; ``state_lists[i]`` is the list of ``STATE_KEYS[i]``. (The
        step count, ``state['step']``, is kept for upstream's layout; neither Lion nor Adagrad uses it.)"""
        raise NotImplementedError

    def sparse_update(self, group, param, grad, state):
        raise RuntimeError(f'{type(self).__name__} does not support sparse gradients')
