# SPDX-License-Identifier: Apache-2.0
"""fp32 master copies of 16-bit model parameters.

With bf16 or fp16 the model holds 16-bit parameters; the optimizer updates fp32
masters, whose ``.grad`` are views of the stage's fp32 gradient buffer (set once,
never copied), and the updated masters are copied back into the model.
"""

import torch


class MasterParams:
    """fp32 masters for ``model_params``; ``grad_view(p)`` gives each master its gradient storage."""

    def __init__(self, model_params, grad_view):
        self.model_params = list(model_params)
        self.masters = []
        self._master_of = {}
        for param in self.model_params:
            master = torch.nn.Parameter(param.detach().to(torch.float32).clone(), requires_grad=True)
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

    @torch.no_grad()
    def copy_to_model(self):
        if self.model_params:
            torch._foreach_copy_(self.model_params, self.masters)

    @torch.no_grad()
    def copy_from_model(self):
        if self.model_params:
            torch._foreach_copy_(self.masters, self.model_params)
