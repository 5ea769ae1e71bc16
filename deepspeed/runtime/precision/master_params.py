# SPDX-License-Identifier: Apache-2.0
"""fp32 master copies of 16-bit model parameters.

With bf16 or fp16 the model holds 16-bit parameters; the optimizer updates fp32
masters and the updated masters are copied back into the model. With an fp32 window
gradient the masters' ``.grad`` are views of it, set once and never copied; with a
lower-precision window the stage attaches fp32 gradients for each step and drops them
after (:meth:`MasterParams.drop_step_grads`).
"""

import torch


class MasterParams:
    """fp32 masters for ``model_params``; ``grad_view(p)`` (optional) gives each master its gradient storage."""

    def __init__(self, model_params, grad_view=None):
        self.model_params = list(model_params)
        self.masters = []
        self._master_of = {}
        self._persistent_grads = grad_view is not None
        for param in self.model_params:
            master = torch.nn.Parameter(param.detach().to(torch.float32).clone(), requires_grad=True)
            if grad_view is not None:
                master.grad = grad_view(param)
            self.masters.append(master)
            self._master_of[param] = master

    def master_of(self, param):
        return self._master_of.get(param)

    def swap_into(self, param_groups):
        """Point every optimizer param group at the masters instead of the model parameters.

        The group dicts themselves are kept (schedulers hold references to them).
        """
        for group in param_groups:
            group["params"] = [self._master_of.get(p, p) for p in group["params"]]

    def drop_step_grads(self):
        """Free the per-step fp32 gradients (kept when they are views of the window gradient)."""
        if not self._persistent_grads:
            for master in self.masters:
                master.grad = None

    @torch.no_grad()
    def copy_to_model(self):
        if self.model_params:
            torch._foreach_copy_(self.model_params, self.masters)

    @torch.no_grad()
    def copy_from_model(self):
        if self.model_params:
            torch._foreach_copy_(self.masters, self.model_params)
