# SPDX-License-Identifier: Apache-2.0
"""AdamW over the selected columns of each weight: upstream's ZenFlow device-step optimizers, by their names.

ZenFlow updates, at every step, only the most important columns of each 2-D weight on the device. The
selection is handed to these optimizers on the parameters themselves:

* ``param.selected_indices``: the selected column indices of a 2-D weight (1-D parameters are taken whole);
* ``param.selected_grad``: the gradient of those columns;
* optionally ``param.temp_selected_param``: a snapshot of the selected columns (``temp_copy_param``), the values
  the next update starts from.

``step()`` runs torch's AdamW (decoupled weight decay, bias correction, ``amsgrad``) on the selected columns of
every parameter that has a ``selected_grad``, writes the columns back, and clears ``selected_grad`` and
``temp_selected_param``. The optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``) has the shape of the
selection and persists across steps until ``clear_selected_mv()`` zeroes the moments (a new selection; the step
count goes on, as upstream's does). Parameters without ``selected_grad`` are left alone.

With ``offload=True`` the moments live in host tensors on the parameter (``param.exp_avg_cpu_data``,
``param.exp_avg_sq_cpu_data``, set up by the caller): each update copies them in and back; ``step()`` updates
parameters in buckets of about ``bucket_size`` elements.

Where the columns live:

* :class:`ZenFlowSelectiveAdamW` (ZeRO 1/2): in the parameter, ``param.data[:, selected_indices]``;
  ``selected_grad`` is ``[rows, k]``.
* :class:`ZenFlowSelectiveAdamW_stage3` (ZeRO 3): in the parameter's shard ``param.ds_tensor``, which holds
  the weight transposed, as upstream's ZeRO-3 ZenFlow lays it out: ``param.ds_shape`` is ``(columns, rows)``,
  and the shard's whole columns are ``ds_tensor[complete_column_offset:][:complete_numel]`` viewed as
  ``(complete_numel // rows, rows)``, of which the rows ``selected_indices`` are selected; ``selected_grad`` is
  ``[k, rows]``. A shard on another device than the gradient (offloaded parameters) is stepped on the
  gradient's device and written back; a shard on NVMe (a 0-dim ``ds_tensor`` with ``param.nvme_swapper``) is
  swapped in for the update and out after it, one parameter at a time (``temp_copy_param`` only reads it:
  released, not written back). ``group_step`` takes a list of parameters, grouped by ``param.group_id``.

These are the classes upstream's code and tests construct; this runtime's own ZenFlow step
(``deepspeed/runtime/zenflow``) keeps its device part in fp32 buffers of its own.
"""

import torch
from torch.optim.adamw import adamw


class _SelectiveAdamW(torch.optim.AdamW):
    """AdamW over what :meth:`_read` selects of each parameter (the subclasses say where the columns live)."""

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

    # where the selection lives (subclasses) ---------------------------------
    def _read(self, param):
        """The selected values of ``param`` (a tensor the update may write; written back by :meth:`_write`)."""
        raise NotImplementedError

    def _write(self, param, values):
        raise NotImplementedError

    def _resident(self, param):
        """Make ``param``'s storage readable; returns a callable that puts it back after ``(written)``."""
        return lambda written: None

    # -------------------------------------------------------------- helpers
    def copy_mv_from_cpu(self, params):
        for param in params:
            device = param.selected_grad.device if getattr(param, "selected_grad", None) is not None else None
            param.exp_avg = param.exp_avg_cpu_data.to(device or param.exp_avg_cpu_data.device, non_blocking=True)
            param.exp_avg_sq = param.exp_avg_sq_cpu_data.to(device or param.exp_avg_sq_cpu_data.device,
                                                            non_blocking=True)

    def copy_mv_to_cpu(self, params):
        for param in params:
            for home, moment in ((param.exp_avg_cpu_data, param.exp_avg), (param.exp_avg_sq_cpu_data,
                                                                           param.exp_avg_sq)):
                if moment.data_ptr() != home.data_ptr():  # on a CPU-only machine they are the same tensor
                    home.copy_(moment.data.view_as(home), non_blocking=True)
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

    def _snapshot(self, param):
        restore = self._resident(param)
        snapshot = self._read(param).clone().detach()
        restore(False)
        param.temp_selected_param = snapshot.cpu() if self.offload else snapshot

    @staticmethod
    def _selected_params(params):
        return [p for p in params if getattr(p, "selected_grad", None) is not None]

    @torch.no_grad()
    def _update(self, group, params):
        """One AdamW update of the selected columns of ``params`` (all of them carry ``selected_grad``)."""
        amsgrad = group["amsgrad"]
        beta1, beta2 = group["betas"]
        for param in params:
            restore = self._resident(param)
            grad = param.selected_grad
            snapshot = getattr(param, "temp_selected_param", None)
            values = self._read(param) if snapshot is None else snapshot.to(grad.device).clone()
            values = values.to(grad.device)
            state = self.state.setdefault(param, {})
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=grad.device)
                if amsgrad:
                    state["max_exp_avg_sq"] = torch.zeros_like(values)
                if not self.offload:
                    state["exp_avg"] = torch.zeros_like(values)
                    state["exp_avg_sq"] = torch.zeros_like(values)
            if self.offload:
                self.copy_mv_from_cpu([param])
                exp_avg, exp_avg_sq = param.exp_avg.view_as(values), param.exp_avg_sq.view_as(values)
            else:
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            adamw([values], [grad.to(values.dtype)], [exp_avg], [exp_avg_sq],
                  [state["max_exp_avg_sq"]] if amsgrad else [], [state["step"]],
                  foreach=False,
                  amsgrad=amsgrad,
                  beta1=beta1,
                  beta2=beta2,
                  lr=group["lr"],
                  weight_decay=group["weight_decay"],
                  eps=group["eps"],
                  maximize=False)
            self._write(param, values)
            if self.offload:
                param.exp_avg, param.exp_avg_sq = exp_avg, exp_avg_sq
                self.copy_mv_to_cpu([param])
            restore(True)
            param.selected_grad = None
            param.temp_selected_param = None

    @torch.no_grad()
    def _step_without_offload(self, closure=None):
        for group in self.param_groups:
            self._update(group, self._selected_params(group["params"]))

    @torch.no_grad()
    def _step_with_offload(self, closure=None):
        for group in self.param_groups:
            bucket, numel = [], 0
            for param in self._selected_params(group["params"]):
                bucket.append(param)
                numel += param.selected_grad.numel()
                if numel >= self.bucket_size:
                    self._update(group, bucket)
                    bucket, numel = [], 0
            self._update(group, bucket)


class ZenFlowSelectiveAdamW(_SelectiveAdamW):
    """ZeRO 1/2: the selected columns ``param.data[:, selected_indices]`` (see the module docstring)."""

    def _read(self, param):
        return param.data[:, param.selected_indices] if param.dim() != 1 else param.data.clone()

    def _write(self, param, values):
        if param.dim() != 1:
            param.data[:, param.selected_indices] = values.to(param.dtype)
        else:
            param.data.copy_(values)

    def temp_copy_param(self, group_to_paramlist):
        """Snapshot the selected columns of each selected parameter (the next update starts from them)."""
        for params in group_to_paramlist.values():
            for param in self._selected_params(params):
                self._snapshot(param)

    @torch.no_grad()
    def group_step(self, group_to_paramlist):
        """Update the given parameters of each param group (``{group index: [params]}``)."""
        for group_id, params in group_to_paramlist.items():
            self._update(self.param_groups[group_id], self._selected_params(params))


class ZenFlowSelectiveAdamW_stage3(_SelectiveAdamW):
    """ZeRO 3: the selected columns are rows of the transposed shard ``param.ds_tensor`` (module docstring)."""

    @staticmethod
    def _columns_view(param):
        num_rows = param.ds_shape[1]
        data = param.ds_tensor.data.narrow(0, param.complete_column_offset, param.complete_numel)
        return data.view(param.complete_numel // num_rows, num_rows)

    def _read(self, param):
        if len(param.ds_shape) == 1:
            return param.ds_tensor.data.clone()
        view = self._columns_view(param)
        return view[param.selected_indices.to(view.device).long(), :]

    def _write(self, param, values):
        if len(param.ds_shape) == 1:
            param.ds_tensor.data.copy_(values)
            return
        view = self._columns_view(param)
        view[param.selected_indices.to(view.device).long(), :] = values.to(device=view.device, dtype=view.dtype)

    def _resident(self, param):
        """An NVMe-offloaded shard (0-dim ``ds_tensor``) is swapped in; after an update it is swapped out (written
        back), after a read only released."""
        swapper = getattr(param, "nvme_swapper", None)
        if param.ds_tensor.data.dim() != 0 or swapper is None:
            return lambda written: None
        swapper.swap_in([param], async_op=False)

        def restore(written):
            if written:
                swapper.swap_out_and_release([param])
            else:
                swapper.remove_partition_and_release_buffers([param])

        return restore

    def temp_copy_param(self, paramlist):
        """Snapshot the selected columns of each selected parameter (the next update starts from them)."""
        for param in self._selected_params(paramlist):
            self._snapshot(param)

    @torch.no_grad()
    def group_step(self, paramlist):
        """Update the given parameters, each with its param group (``param.group_id``)."""
        by_group = {}
        for param in self._selected_params(paramlist):
            by_group.setdefault(param.group_id, []).append(param)
        for group_id in sorted(by_group):
            self._update(self.param_groups[group_id], by_group[group_id])
