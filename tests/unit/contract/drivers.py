# SPDX-License-Identifier: Apache-2.0
"""Two ways to run one graph shape: through DeepSpeed engines, or as the plain-torch reference.

A graph shape is written once against the small driver interface below. The engine
driver calls the engines exactly as a user would. The reference driver computes,
without any DeepSpeed code, the contract formula for the same calls:

    grad(p) += s_c(E) * dL_c/dp / W,   s_c(E) = 1/GAS_E  (1 with scale_wrt_gas=False)

with ``dL_c/dp`` from ``torch.autograd.grad`` on a plain copy of the model in the same
dtype (fp16: of the loss times the same loss scale, then divided by it, as the maths
of loss scaling says). Activation checkpointing is left out of the reference: it
does not change the maths.
"""

import contextlib

import torch


class EngineDriver:

    def __init__(self, engines, fp16):
        self.engines = engines
        self.models = [e.module for e in engines]
        self.gas = [e.gradient_accumulation_steps() for e in engines]
        self.fp16 = fp16

    def fwd(self, i, *args, **kwargs):
        return self.engines[i](*args, **kwargs)

    def backward(self, loss, i=0, retain_graph=False, scale_wrt_gas=True):
        self.engines[i].backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    def direct(self, tensor, grad=None, retain_graph=False):
        """A direct ``.backward()``; under fp16 its only legal form, ``engine.scale(t).backward()``.

        ``engine.scale`` takes a scalar loss, as upstream's; under fp16 a non-scalar ``tensor.backward(grad)``
        becomes the scalar ``(tensor * grad).sum()``, whose backward sends exactly ``grad`` into ``tensor``.
        """
        if self.fp16:
            if grad is not None:
                tensor, grad = (tensor.float() * grad.float()).sum(), None
            tensor = self.engines[0].scale(tensor)
        tensor.backward(grad, retain_graph=retain_graph)

    def scaled(self, loss, i=0, retain_graph=False):
        self.engines[i].scale(loss).backward(retain_graph=retain_graph)

    def zero_grad(self):
        for engine in self.engines:
            engine.zero_grad()


class ReferenceDriver:
    """Accumulates one rank's micro-step of the contract's expected gradient into ``local[i][name]`` (fp32).

    ``zero_grad()`` drops what this rank contributed so far and flags that the
    window's earlier contributions are dropped too (every rank calls it at the same
    point); the runner merges the ranks' ``local`` into the window afterwards.
    """

    def __init__(self, models, gas, divisor, loss_scale):
        self.models = models
        self.gas = gas
        self.divisor = divisor  # W for a mean reduction, 1 for a sum
        self.loss_scale = loss_scale
        self.local = [{n: torch.zeros(p.shape, device=p.device) for n, p in m.named_parameters()} for m in models]
        self.zeroed = False
        self._owned = []
        for i, model in enumerate(models):
            for name, param in model.named_parameters():
                self._owned.append((i, name, param))

    def fwd(self, i, *args, **kwargs):
        kwargs.pop("ckpt", None)
        return self.models[i](*args, **kwargs)

    def _take(self, tensor, grad, scale_wrt_gas, loss_scale):
        params = [p for _, _, p in self._owned]
        grads = torch.autograd.grad(tensor * loss_scale,
                                    params,
                                    grad_outputs=grad,
                                    retain_graph=True,
                                    allow_unused=True)
        for (i, name, _), g in zip(self._owned, grads):
            if g is None:
                continue
            s = (1.0 / self.gas[i]) if scale_wrt_gas else 1.0
            self.local[i][name] += g.float() * (s / loss_scale / self.divisor)

    def backward(self, loss, i=0, retain_graph=False, scale_wrt_gas=True):
        self._take(loss, None, scale_wrt_gas, self.loss_scale)

    def direct(self, tensor, grad=None, retain_graph=False):
        self._take(tensor, grad, True, self.loss_scale)

    def scaled(self, loss, i=0, retain_graph=False):
        self._take(loss, None, True, self.loss_scale)

    def zero_grad(self):
        for grads in self.local:
            for g in grads.values():
                g.zero_()
        self.zeroed = True


def protocol_context(protocol, engines, boundary, coalesce=False):
    """The context a micro-step of ``protocol`` runs in; ``coalesce`` adds ``coalesce_grad_reduction()``
    to any protocol (with unmanaged accumulation, an extension upstream rejects)."""
    if protocol == "no_sync" and not boundary:
        return engines[0].no_sync()
    if protocol == "coalesce" or coalesce:
        return engines[0].coalesce_grad_reduction()
    return contextlib.nullcontext()
