# SPDX-License-Identifier: Apache-2.0
"""``ZenFlowSelectiveAdamW``: AdamW over the selected columns of each weight (upstream's ZenFlow device step).

ZenFlow updates, at every step, only the most important columns of each 2-D weight on the device. The
selection is handed to this optimizer on the parameters themselves:

* ``param.selected_indices``: the selected column indices of a 2-D ``param`` (1-D parameters are taken whole);
* ``param.selected_grad``: the gradient of those columns, shape ``[rows, len(selected_indices)]`` (or the
  parameter's shape for 1-D);
* optionally ``param.temp_selected_param``: a snapshot of the selected columns (``temp_copy_param``) that is
  written back before the update.

``step()`` runs torch's AdamW (decoupled weight decay, bias correction, ``amsgrad``) on the selected columns of
every parameter that has a ``selected_grad``, writes the columns back, and clears ``selected_grad`` and
``temp_selected_param``. The optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``) has the shape of the
selection and persists across steps until ``clear_selected_mv()`` zeroes it (a new selection). Parameters
without ``selected_grad`` are left alone.

With ``offload=True`` the moments live in host tensors on the parameter (``param.exp_avg_cpu_data``,
``param.exp_avg_sq_cpu_data``, set up by the caller): each step copies them in, updates, and copies them back;
parameters are stepped in buckets of about ``bucket_size`` elements.

``ZenFlowSelectiveAdamW_stage3`` (ZenFlow on ZeRO-3) is not built.
"""

import torch
from torch.optim.adamw import adamw

from deepspeed.runtime.not_built import not_built_class


def _selected(param):
    return param.data[:, param.selected_indices] if param.dim() != 1 else param.data


class ZenFlowSelectiveAdamW(torch.optim.AdamW):
    """See the module docstring."""

    def __init__(self, *args, offload=False, bucket_size=5e8, **kwargs):
        super().__init__(*args, **kwargs)
        self.offload = offload
        self.bucket_size = bucket_size
        self.step = self._step_with_offload if offload else self._step_without_offload

    def __setstate__(self, state):
        super().__setstate__(state)
        for param_state in self.state.values():
            step = param_state.get("step")
            if torch.is_tensor(step) and step.dtype in (torch.float16, torch.bfloat16):
                param_state["step"] = step.float()

    def temp_copy_param(self, group_to_paramlist):
        """Snapshot the selected columns of each selected parameter (restored before the next update)."""
        for params in group_to_paramlist.values():
            for param in params:
                if hasattr(param, "selected_grad"):
                    snapshot = _selected(param).clone().detach()
                    param.temp_selected_param = snapshot.cpu() if self.offload else snapshot

    def copy_mv_from_cpu(self, params):
        for param in params:
            param.exp_avg = param.exp_avg_cpu_data.to(param.device, non_blocking=True)
            param.exp_avg_sq = param.exp_avg_sq_cpu_data.to(param.device, non_blocking=True)

    def copy_mv_to_cpu(self, params):
        for param in params:
            param.exp_avg_cpu_data.copy_(param.exp_avg.data, non_blocking=True)
            param.exp_avg_sq_cpu_data.copy_(param.exp_avg_sq.data, non_blocking=True)
            param.exp_avg = None
            param.exp_avg_sq = None

    def clear_selected_mv(self):
        """Zero the moments of every parameter (the selection changed)."""
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param)
                if not state:
                    continue
                if self.offload:
                    param.exp_avg_cpu_data.zero_()
                    param.exp_avg_sq_cpu_data.zero_()
                else:
                    state["exp_avg"].zero_()
                    state["exp_avg_sq"].zero_()

    def _restore_snapshot(self, param):
        snapshot = getattr(param, "temp_selected_param", None)
        if snapshot is None:
            return
        if param.dim() != 1:
            param.data[:, param.selected_indices] = snapshot.to(param.device)
        else:
            param.data.copy_(snapshot.to(param.device))
        param.temp_selected_param = None

    @torch.no_grad()
    def _update(self, group, params):
        """One AdamW update of the selected columns of ``params`` (all of them carry ``selected_grad``)."""
        amsgrad = group["amsgrad"]
        beta1, beta2 = group["betas"]
        if self.offload:
            self.copy_mv_from_cpu(params)
        values, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []
        for param in params:
            self._restore_snapshot(param)
            value = _selected(param)
            state = self.state.setdefault(param, {})
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=value.device)
                if amsgrad:
                    state["max_exp_avg_sq"] = torch.zeros_like(value)
                if not self.offload:
                    state["exp_avg"] = torch.zeros_like(value)
                    state["exp_avg_sq"] = torch.zeros_like(value)
            values.append(value)
            grads.append(param.selected_grad)
            exp_avgs.append(param.exp_avg.view_as(value) if self.offload else state["exp_avg"])
            exp_avg_sqs.append(param.exp_avg_sq.view_as(value) if self.offload else state["exp_avg_sq"])
            if amsgrad:
                max_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
        if params:
            adamw(values,
                  grads,
                  exp_avgs,
                  exp_avg_sqs,
                  max_sqs,
                  steps,
                  foreach=False,
                  amsgrad=amsgrad,
                  beta1=beta1,
                  beta2=beta2,
                  lr=group["lr"],
                  weight_decay=group["weight_decay"],
                  eps=group["eps"],
                  maximize=False)
        for param, value in zip(params, values):
            if param.dim() != 1:  # the selection was a copy (advanced indexing): write it back
                param.data[:, param.selected_indices] = value
            param.selected_grad = None
            param.temp_selected_param = None
        if self.offload:
            self.copy_mv_to_cpu(params)

    @torch.no_grad()
    def _step_without_offload(self, closure=None):
        for group in self.param_groups:
            self._update(group, [p for p in group["params"] if getattr(p, "selected_grad", None) is not None])

    @torch.no_grad()
    def _step_with_offload(self, closure=None):
        for group in self.param_groups:
            bucket, numel = [], 0
            for param in group["params"]:
                if getattr(param, "selected_grad", None) is None:
                    continue
                bucket.append(param)
                numel += param.numel()
                if numel >= self.bucket_size:
                    self._update(group, bucket)
                    bucket, numel = [], 0
            self._update(group, bucket)

    @torch.no_grad()
    def group_step(self, group_to_paramlist):
        """Update the given parameters of each param group (``{group index: [params]}``)."""
        for group_id, params in group_to_paramlist.items():
            self._update(self.param_groups[group_id],
                         [p for p in params if getattr(p, "selected_grad", None) is not None])


ZenFlowSelectiveAdamW_stage3 = not_built_class("ZenFlowSelectiveAdamW_stage3",
                                               "ZenFlow on ZeRO stage 3",
                                               bases=(torch.optim.AdamW, ),
                                               module=__name__)
