# SPDX-License-Identifier: Apache-2.0
"""``step_subgroup`` / ``rollback_subgroup`` of ``DeepSpeedCPUAdam`` (upstream's ZeRO-3 offload sub-group API).

The optimizer state of a sub-group is kept under the sub-group's index (``optimizer.state[subgroup_id]``), not
under a parameter: the caller points the optimizer's param group at one sub-group's flat fp32 partition at a
time and steps that sub-group. ``step_subgroup(i)`` runs one Adam (``adamw_mode=False``: L2 weight decay added to
the gradient) or AdamW (decoupled weight decay) update, with bias correction, on every parameter that has a
gradient, creating the moments (fp32, or the parameter's dtype with ``fp32_optimizer_states=False``) on first use.
``rollback_subgroup(i)`` undoes the last such update exactly in real arithmetic (to rounding in floating point):
it restores the parameter and both moments from the same gradient and lowers the step count.
"""

import torch


def _coefficients(group, step):
    beta1, beta2 = group["betas"]
    return beta1, beta2, 1 - beta1**step, (1 - beta2**step)**0.5


class SubgroupStepMixin:
    """Adds the two methods of the module docstring to an Adam whose groups have ``lr``, ``betas``, ``eps``,
    ``weight_decay`` and whose instance has ``adam_w_mode`` and ``fp32_optimizer_states``."""

    def _subgroup_params(self):
        return [p for group in self.param_groups for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def step_subgroup(self, subgroup_id: int, closure=None):
        """One update of the sub-group ``subgroup_id`` (see the module docstring); returns ``closure()``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        state = self.state[subgroup_id]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not state:
                    dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
                state["step"] += 1
                beta1, beta2, bias1, bias2_sqrt = _coefficients(group, state["step"])
                lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
                value, grad = p.data.float(), p.grad.float()
                if wd and not self.adam_w_mode:
                    grad = grad + wd * value
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad.to(m.dtype), alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad.to(v.dtype), grad.to(v.dtype), value=1 - beta2)
                if wd and self.adam_w_mode:
                    value = value * (1 - lr * wd)
                value = value - (lr / bias1) * m.float() / (v.float().sqrt() / bias2_sqrt + eps)
                p.data.copy_(value)
        return loss

    @torch.no_grad()
    def rollback_subgroup(self, sub_group_id: int, closure=None):
        """Undo the last :meth:`step_subgroup` of ``sub_group_id`` with the same gradients."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        state = self.state.get(sub_group_id) if sub_group_id in self.state else None
        if not state:
            raise RuntimeError(f"Cannot rollback optimizer state for sub_group_id {sub_group_id} as it has not been "
                               f"initialized.")
        if state.get("step", 0) <= 0:
            raise RuntimeError(f"Cannot rollback sub_group_id {sub_group_id}: step count is {state.get('step', 0)}")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                beta1, beta2, bias1, bias2_sqrt = _coefficients(group, state["step"])
                lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                value = p.data.float() + (lr / bias1) * m.float() / (v.float().sqrt() / bias2_sqrt + eps)
                if wd and self.adam_w_mode:
                    value = value / (1 - lr * wd)
                grad = p.grad.float()
                if wd and not self.adam_w_mode:
                    grad = grad + wd * value
                m.sub_(grad.to(m.dtype), alpha=1 - beta1).div_(beta1)
                v.addcmul_(grad.to(v.dtype), grad.to(v.dtype), value=-(1 - beta2)).div_(beta2).clamp_(min=0)
                p.data.copy_(value)
        state["step"] -= 1
        return loss
