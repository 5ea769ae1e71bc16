# SPDX-License-Identifier: Apache-2.0
"""The optimizer object ``deepspeed.initialize`` returns, and the boundary step it runs.

It wraps the client's (or the config's) torch optimizer and keeps its
``param_groups`` list and dicts (the same objects: LR schedulers built on them keep
working), its ``state``, ``state_dict``/``load_state_dict``, and adds the loss scaler.

The boundary step, in order, the same on every rank:

1. the stage finishes this window's reductions;
2. overflow check (fp16 always, bf16 unless ``bf16.check_grad_overflow`` is false, fp32 when
   ``check_grad_overflow`` is set): a step whose global gradient norm is not finite is skipped on
   every rank (the verdict comes from reduced gradients), the loss scale drops (fp16), the window
   is discarded;
3. the global gradient norm (kept for ``get_global_grad_norm``, also with clipping off);
4. clipping: gradients scaled by ``min(1, clip / (norm + 1e-6))``, on the device, no sync;
5. the inner optimizer steps (on fp32 masters for 16-bit models) and the model is updated.
"""

import torch

from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.utils.timer import OPTIMIZER_GRADIENTS_TIMER


class EngineOptimizer(ZeROOptimizer):
    """The engine's optimizer: the client optimizer plus precision, clipping and the stage's gradients."""

    # Upstream's loss-scaling attributes, read by its tests and by frameworks: this runtime has no
    # custom (external) loss scale and no torch.amp GradScaler; fp16 loss scaling is `loss_scaler`.
    custom_loss_scaler = False
    external_loss_scale = None
    torch_autocast_gradscaler = None

    def __init__(self, inner, stage, loss_scaler, gradient_clipping, zero_grad_fn, check_overflow):
        self.optimizer = inner
        self.stage = stage
        self.loss_scaler = loss_scaler
        self.gradient_clipping = float(gradient_clipping or 0.0)
        self._zero_grad_fn = zero_grad_fn
        # Upstream's attribute name; users set it to turn the check on for fp32.
        self.check_grad_overflow = bool(check_overflow)
        self.overflow = False
        self._global_grad_norm = None

    # torch.optim.Optimizer-like surface -----------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def speculative_stats(self):
        """Counters of speculative offloaded steps (``offload_optimizer.super_offload``), or None without them."""
        return self.stage.speculative_stats

    @property
    def defaults(self):
        return self.optimizer.defaults

    @property
    def loss_scale(self):
        return self.loss_scaler.loss_scale

    @property
    def cur_scale(self):
        return self.loss_scaler.loss_scale

    @property
    def dynamic_loss_scale(self):
        return self.loss_scaler.dynamic

    engine_states = None  # the engine's EngineStates (engine_parts/states.py), set by the engine

    def offload_states(self, include=None, device="cpu", pin_memory=True, non_blocking=False):
        """The engine's ``offload_states`` (upstream offers it on the optimizer too; OpenRLHF calls it here)."""
        self.engine_states.offload(include=include, device=device, pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking=False):
        """The engine's ``reload_states``."""
        self.engine_states.reload(non_blocking=non_blocking)

    def needs_scaler(self):
        """Whether a backward must be loss-scaled (fp16): a direct ``loss.backward()`` then raises,
        ``engine.backward(loss)`` or ``engine.scale(loss).backward()`` are required."""
        return bool(self.stage.config.requires_loss_scale)

    def zero_grad(self, set_to_none=True):
        """Discard the gradients of the current accumulation window."""
        self._zero_grad_fn()

    def step(self, closure=None):
        """Apply the boundary step to the gradients accumulated so far (``engine.step()`` is the usual way)."""
        if closure is not None:
            raise NotImplementedError("DeepSpeed optimizers do not take a closure")
        if self.engine_states is not None:
            self.engine_states.require("step")
        applied = self.boundary_step()
        self.stage.zero_window()
        return applied

    def state_dict(self):
        self.stage._masters_current()  # a step still running completes; an undecided speculative one is undone
        return {
            "optimizer": self.optimizer.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict(),
            "overflow": self.overflow,
        }

    def load_state_dict(self, state_dict, load_optimizer_states=True):
        self.stage._masters_current()
        if "optimizer" not in state_dict:  # a plain torch optimizer state dict
            self.optimizer.load_state_dict(state_dict)
            return
        if load_optimizer_states:
            self.optimizer.load_state_dict(state_dict["optimizer"])
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.overflow = state_dict.get("overflow", False)

    # the boundary step -----------------------------------------------------
    def boundary_step(self):
        """Run steps 1-5 of the module docstring; return whether the update was applied."""
        stage = self.stage
        stage.finish_window()
        self.overflow = self.check_grad_overflow and stage.found_overflow()
        if self.overflow:
            self._global_grad_norm = stage.global_grad_norm()  # inf or nan: get_global_grad_norm() shows which
            self.loss_scaler.update_scale(True)
            return False
        with stage.timed(OPTIMIZER_GRADIENTS_TIMER):
            norm = stage.global_grad_norm()
            self._global_grad_norm = norm
            if self.gradient_clipping > 0:
                coef = torch.clamp(self.gradient_clipping / (norm + 1e-6), max=1.0)
                stage.scale_grads(coef)
        stage.optimizer_step()
        self.loss_scaler.update_scale(False)
        return True

    def global_grad_norm(self):
        norm = self._global_grad_norm
        return None if norm is None else float(norm)
