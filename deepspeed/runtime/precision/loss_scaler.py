# SPDX-License-Identifier: Apache-2.0
"""fp16 loss scaling: a static scale, or a dynamic one that backs off on overflow.

Dynamic rule (the config keys of the ``fp16`` section):

* on an overflowing step: if the hysteresis budget is spent, the scale is divided by 2
  (never below ``min_loss_scale``); otherwise one unit of hysteresis is used up;
* after ``loss_scale_window`` consecutive good steps since the last overflow, the
  scale is multiplied by 2 and the hysteresis budget refilled; with
  ``consecutive_hysteresis`` the budget is refilled after every good step.

The overflow decision is made by the caller, identically on every rank (the flag is
computed from reduced gradients or agreed with a collective), so every rank's scaler
follows the same sequence.
"""


def advance_dynamic_scale(scaler, overflow):
    """One step of the dynamic rule (module docstring) on any object with the dynamic scaler's fields.

    Upstream's pickled scaler class (``deepspeed.runtime.fp16.loss_scaler``) uses it too, so both follow one rule.
    """
    if overflow:
        if scaler.delayed_shift == 1 or scaler.cur_hysteresis == 1:
            if scaler.cur_scale <= scaler.min_scale and scaler.raise_error_at_min_scale:
                raise RuntimeError(f"fp16 gradients overflow at the minimum loss scale {scaler.min_scale}: "
                                   f"training has diverged or min_loss_scale is too high")
            scaler.cur_scale = max(scaler.cur_scale / scaler.scale_factor, scaler.min_scale)
        else:
            scaler.cur_hysteresis -= 1
        scaler.last_overflow_iter = scaler.cur_iter
    else:
        if scaler.consecutive_hysteresis:
            scaler.cur_hysteresis = scaler.delayed_shift
        if (scaler.cur_iter - scaler.last_overflow_iter) % scaler.scale_window == 0:
            if not scaler.consecutive_hysteresis:
                scaler.cur_hysteresis = scaler.delayed_shift
            scaler.cur_scale *= scaler.scale_factor
    scaler.cur_iter += 1


class LossScaler:
    """A constant loss scale."""

    dynamic = False

    def __init__(self, scale=1.0):
        self.cur_scale = float(scale)

    @property
    def loss_scale(self):
        return self.cur_scale

    def update_scale(self, overflow):
        pass

    def scale_loss(self, loss):
        """``loss`` times the current scale (upstream's name; the engine seeds its losses itself)."""
        return loss * self.loss_scale

    def state_dict(self):
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state):
        self.cur_scale = float(state["cur_scale"])


class DynamicLossScaler(LossScaler):
    """A loss scale that halves on overflow and doubles after a window of good steps."""

    dynamic = True

    def __init__(self,
                 init_scale=2.0**16,
                 scale_factor=2.0,
                 scale_window=1000,
                 min_scale=1.0,
                 delayed_shift=2,
                 consecutive_hysteresis=False,
                 raise_error_at_min_scale=False):
        super().__init__(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.cur_hysteresis = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update_scale(self, overflow):
        advance_dynamic_scale(self, overflow)

    def state_dict(self):
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state):
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])


def create_loss_scaler(fp16_enabled, static_loss_scale, dynamic_args):
    """The scaler for a config: none-like (scale 1) unless fp16; static if ``loss_scale`` > 0."""
    if not fp16_enabled:
        return LossScaler(1.0)
    if static_loss_scale and static_loss_scale > 0:
        return LossScaler(static_loss_scale)
    return DynamicLossScaler(**(dynamic_args or {}))
