# SPDX-License-Identifier: Apache-2.0
"""``DeepSpeedCPUAdam``: the Adam used for optimizer offload, on torch's CPU kernels.

Same machinery as :class:`~deepspeed.ops.adam.fused_adam.FusedAdam` (torch's fused CPU
Adam kernel where the torch build has it, foreach otherwise), with upstream's constructor
and two upstream behaviours the offload path relies on:

- ``fp32_optimizer_states=True`` (default): a float16/bfloat16 parameter keeps its moments
  in float32; its update is computed on a float32 copy of the parameter and gradient and
  rounded back into the parameter. With ``False`` the moments take the parameter's dtype.
- ``step(closure=None, fp16_param_groups=None)``: after the update, each stepped parameter
  is also copied into the matching tensor of ``fp16_param_groups`` (one list per group, or
  a single list / tensor for one group), e.g. the low-precision model weights.

A float32 CPU parameter whose ``fp16_param_groups`` target is a bf16/fp16 CPU tensor (a pinned
upload buffer, say) is updated by the host Adam op (``deepspeed.ops.adam.host_adam``: one
multithreaded pass that also writes the target, built on first use); ``DS_NATIVE_CPU_ADAM=1``
uses the op for every float32 CPU update, ``=0`` never. Without a C++ compiler torch's kernels
run instead (same results to float32 rounding, same state layout).
"""

import torch

from deepspeed.ops.adam import host_adam
from deepspeed.ops.adam.fused_adam import TorchKernelAdam
from deepspeed.ops.adam.subgroup_step import SubgroupStepMixin

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_MOMENT_KEYS = ('exp_avg', 'exp_avg_sq', 'max_exp_avg_sq')


def _as_group_lists(fp16_param_groups):
    if torch.is_tensor(fp16_param_groups):
        return [[fp16_param_groups]]
    if fp16_param_groups and not isinstance(fp16_param_groups[0], (list, tuple)):
        return [fp16_param_groups]
    return fp16_param_groups


class DeepSpeedCPUAdam(SubgroupStepMixin, TorchKernelAdam):
    """Adam (``adamw_mode=False``) or AdamW (``adamw_mode=True``, the default) for offloaded states.

    Parameters may live on any device (the kernels are torch's), though the offload path
    gives it float32 CPU master weights. ``bias_correction=False`` raises NotImplementedError.
    """

    def __init__(self,
                 model_params,
                 lr=1e-3,
                 bias_correction=True,
                 betas=(0.9, 0.999),
                 eps=1e-8,
                 weight_decay=0,
                 amsgrad=False,
                 adamw_mode=True,
                 fp32_optimizer_states=True):
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
        super().__init__(model_params,
                         lr=lr,
                         bias_correction=bias_correction,
                         betas=betas,
                         eps=eps,
                         weight_decay=weight_decay,
                         amsgrad=amsgrad,
                         decoupled_weight_decay=adamw_mode)

    def _steps_in_fp32(self, param):
        return self.fp32_optimizer_states and param.dtype in _LOW_PRECISION

    @torch.no_grad()
    def step(self, closure=None, fp16_param_groups=None):
        """One Adam step; then copy each stepped parameter into ``fp16_param_groups`` if given."""
        stepped = [[p.grad is not None for p in group['params']] for group in self.param_groups]
        # Where the host op may write each parameter's low-precision copy, and which copies it wrote.
        self._copy_targets, self._written_by_op = {}, set()
        if fp16_param_groups is not None:
            for group, targets in zip(self.param_groups, _as_group_lists(fp16_param_groups)):
                for p, target in zip(group['params'], targets):
                    self._copy_targets[p] = target
        try:
            loss = super().step(closure)
            if fp16_param_groups is not None:
                written = self._written_by_op
                for group, targets, flags in zip(self.param_groups, _as_group_lists(fp16_param_groups), stepped):
                    for p, target, was_stepped in zip(group['params'], targets, flags):
                        if was_stepped and p not in written:
                            target.data.copy_(p.data)
        finally:
            self._copy_targets, self._written_by_op = {}, set()
        return loss

    _copy_targets = {}  # outside step(): no copy targets

    def _step_group(self, group, params, grads):
        params, grads = self._step_on_host_op(group, params, grads)
        native = [(p, g) for p, g in zip(params, grads) if not self._steps_in_fp32(p)]
        widened = [(p, g) for p, g in zip(params, grads) if self._steps_in_fp32(p)]
        if native:
            native_params = [p for p, _ in native]
            self._adam(group, native_params, [g for _, g in native], native_params)
        if widened:
            owners = [p for p, _ in widened]
            for owner in owners:
                self._widen_state(owner)
            masters = [p.detach().float() for p in owners]
            self._adam(group, masters, [g.float() for _, g in widened], owners)
            for owner, master in zip(owners, masters):
                owner.copy_(master)

    def _step_on_host_op(self, group, params, grads):
        """Update what the host Adam op supports; return the parameters and gradients left for torch."""
        policy = host_adam.native_policy()
        if not params or policy == "never" or (policy == "copy" and not self._copy_targets):
            return params, grads
        if not host_adam.group_supported(group):
            return params, grads
        op = host_adam.host_adam_op()
        if op is None:
            return params, grads
        rest_params, rest_grads = [], []
        for p, g in zip(params, grads):
            target = self._copy_targets.get(p)
            if not host_adam.copy_target_supported(op, target, p):
                target = None
            if not host_adam.tensor_supported(p, g) or (target is None and policy == "copy"):
                rest_params.append(p)
                rest_grads.append(g)
                continue
            host_adam.adam_step(op, group, p.data, g, self._state_for(p, p, group), target)
            if target is not None:
                self._written_by_op.add(p)  # step() assigned a fresh set before this
        return rest_params, rest_grads

    def _widen_state(self, param):
        """Keep a low-precision parameter's moments in float32 (a loaded checkpoint may narrow them)."""
        state = self.state.get(param)
        if not state:
            return
        for key in _MOMENT_KEYS:
            if key in state and state[key].dtype != torch.float32:
                state[key] = state[key].float()

    def load_state_dict(self, state_dict):
        """torch's load_state_dict, except float32 moments of low-precision parameters stay float32.

        torch casts loaded moments to the parameter's dtype; for parameters stepped in float32
        the saved float32 moments are put back unrounded.
        """
        kept = []
        for saved, current in zip(state_dict['param_groups'], self.param_groups):
            for param_id, param in zip(saved['params'], current['params']):
                saved_state = state_dict['state'].get(param_id)
                if saved_state and self._steps_in_fp32(param):
                    kept.append((param, {k: v for k, v in saved_state.items() if k in _MOMENT_KEYS}))
        super().load_state_dict(state_dict)
        for param, moments in kept:
            for key, value in moments.items():
                self.state[param][key] = value.to(device=param.device, dtype=torch.float32)
