# SPDX-License-Identifier: Apache-2.0
"""Upstream's loss-scaler classes, under the module path its checkpoints pickle.

Upstream DeepSpeed stores its loss scaler in every ZeRO optimizer file as a pickled object
(``optimizer_state_dict["loss_scaler"]``) of ``deepspeed.runtime.fp16.loss_scaler.LossScaler``
or ``DynamicLossScaler``. Unpickling restores the object's attributes without calling
``__init__``, so for such a file to load here these names must resolve, and for a file
written here to load there, the objects must carry the attributes upstream reads:

* both: ``cur_scale``, ``dynamic``;
* dynamic: ``cur_iter``, ``last_overflow_iter``, ``scale_factor``, ``scale_window``,
  ``min_scale``, ``delayed_shift``, ``cur_hysteresis``, ``consecutive_hysteresis``,
  ``raise_error_at_min_scale``, ``dtype``.

The engine's own scaler is :mod:`deepspeed.runtime.precision.loss_scaler`; these classes only
carry state across the two implementations (:func:`to_upstream`, :func:`state_of`). They
also implement upstream's update rule, so a caller that drives one directly (as upstream's
optimizers do) gets the same sequence of scales.
"""

import json

import torch

from deepspeed.runtime.precision.loss_scaler import advance_dynamic_scale

# upstream's keys of the dynamic scaler's arguments
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


class LossScalerBase:
    """State shared by both scalers: the current scale and whether it moves."""

    def __init__(self, cur_scale):
        self.cur_scale = cur_scale
        self.dynamic = False

    @property
    def loss_scale(self):
        return self.cur_scale

    def scale_loss(self, loss):
        return loss * self.loss_scale

    def update_scale(self, overflow):
        pass

    def backward(self, loss, retain_graph=False):
        self.scale_loss(loss).backward(retain_graph=retain_graph)

    def __repr__(self):
        fields = {k: v for k, v in vars(self).items() if not isinstance(v, torch.dtype)}
        return json.dumps(fields, sort_keys=True, indent=4, default=str)


class LossScaler(LossScalerBase):
    """A static loss scale."""

    def __init__(self, scale=1):
        super().__init__(scale)

    def has_overflow(self, params):
        return False


class DynamicLossScaler(LossScalerBase):
    """A loss scale that backs off on overflow (after ``delayed_shift`` overflows) and grows every window."""

    def __init__(self,
                 init_scale=2**32,
                 scale_factor=2.,
                 scale_window=1000,
                 min_scale=1,
                 delayed_shift=1,
                 consecutive_hysteresis=False,
                 raise_error_at_min_scale=True,
                 dtype=torch.half):
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.dynamic = True
        self.dtype = dtype

    def update_scale(self, overflow):
        advance_dynamic_scale(self, overflow)


def to_upstream(scaler, fp16):
    """The upstream-named scaler object for the engine's ``scaler`` (a static scale of 1 when not fp16)."""
    if not fp16 or not getattr(scaler, "dynamic", False):
        return LossScaler(float(scaler.cur_scale) if fp16 else 1.0)
    upstream = DynamicLossScaler(init_scale=float(scaler.cur_scale),
                                 scale_factor=float(scaler.scale_factor),
                                 scale_window=int(scaler.scale_window),
                                 min_scale=float(scaler.min_scale),
                                 delayed_shift=int(scaler.delayed_shift),
                                 consecutive_hysteresis=bool(scaler.consecutive_hysteresis),
                                 raise_error_at_min_scale=bool(scaler.raise_error_at_min_scale))
    upstream.cur_iter = int(scaler.cur_iter)
    upstream.last_overflow_iter = int(scaler.last_overflow_iter)
    upstream.cur_hysteresis = int(scaler.cur_hysteresis)
    return upstream


def state_of(obj):
    """The engine scaler's ``state_dict`` form of an upstream scaler object (or of such a dict); None if neither.

    A static scaler gives ``{"cur_scale"}``; a dynamic one also ``cur_iter``,
    ``last_overflow_iter`` and ``cur_hysteresis``.
    """
    if isinstance(obj, dict):
        return obj if "cur_scale" in obj else None
    if not hasattr(obj, "cur_scale"):
        return None
    state = {"cur_scale": float(obj.cur_scale)}
    if getattr(obj, "dynamic", False):
        state.update(cur_iter=int(getattr(obj, "cur_iter", 0)),
                     last_overflow_iter=int(getattr(obj, "last_overflow_iter", -1)),
                     cur_hysteresis=int(getattr(obj, "cur_hysteresis", getattr(obj, "delayed_shift", 1))))
    return state
