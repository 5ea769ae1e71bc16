# SPDX-License-Identifier: Apache-2.0
"""The ``zero_optimization.zenflow`` section and the schedule it resolves to.

Keys and defaults are upstream's. A ZenFlow step is one ``engine.step()`` (one micro-batch), as in upstream:
``gradient_accumulation_steps`` is replaced by the host window (:func:`accumulation_steps`).

==========================  ==========  ===========================================================
key                         default     meaning here
==========================  ==========  ===========================================================
``topk_ratio``              0.1         share of each weight's columns (``weight[:, j]``) updated on
                                        the device every step; in (0, 1]
``select_strategy``         "auto"      "step", "epoch", or "auto" (= "epoch" with interval 1)
``select_interval``         "auto"      steps (or epochs) between selections; a number requires
                                        "step" or "epoch"
``update_interval``         "auto"      ZenFlow steps (``engine.step()`` calls) per host window;
                                        "auto": the window closes when the unselected gradient has
                                        caught up (see ``zenflow_step.py``)
``overlap_step``            false       the host step of a window runs during the next window
``offload``                 false       the device part's values and moments stay on the host
                                        between steps (copied in and out around each step)
``auto_ratio``              0.99        "auto" update interval: share of the weights that must have
                                        caught up for the window to close
``full_warm_up_rounds``     0           first ZenFlow steps that update everything (no selection)
``pt_reserved_cores_perc``  0.5         share of the cores left to the training thread; the host
                                        worker takes the rest
``steps_per_epoch``         None        epoch length in ZenFlow steps for the "epoch" strategy
                                        (the engine sets it from its training dataloader)
``overlap_apply_after``     "window"    (not an upstream key) with ``overlap_step``: when a window's
                                        host step is applied: "window", when the next window
                                        closes (upstream's); a number ``k``: ``k`` ZenFlow steps
                                        after its launch, at the latest at that close (at the
                                        second step the host worker has finished it anyway)
``window_update``           "once"      (not an upstream key) how the host step of a window of
                                        ``n`` steps moves the unselected elements: "once", one
                                        plain Adam step (upstream's arithmetic); "scaled", one
                                        Adam step with ``n`` times the learning rate; "sqrt", with
                                        ``sqrt(n)`` times; "repeat", ``n`` Adam steps with the
                                        window's mean gradient (docs/offload.md: measured, none
                                        is better than "once" on the GPU reference model)
==========================  ==========  ===========================================================

Errors (:class:`DeepSpeedConfigError`, raised while the config is parsed, so on every rank
and before any collective): ``topk_ratio`` outside (0, 1]; a number ``select_interval``
with strategy "auto" (the strategy fixes the interval); "step"/"epoch" with
``select_interval`` "auto"; a step-based ``select_interval`` shorter than a numeric
``update_interval``; an unknown ``window_update``; an ``overlap_apply_after`` that is neither
a positive integer nor "window".
"""

import dataclasses
import logging
from typing import Optional, Union

from deepspeed.runtime.config_utils import (ConfigSection, DeepSpeedConfigError, boolean, config_field, integer,
                                            number, one_of, optional)
from deepspeed.utils.logging import log_dist

AUTO = "auto"
STRATEGIES = ("auto", "step", "epoch")
WINDOW_UPDATES = ("scaled", "sqrt", "repeat", "once")


def _interval():

    def parse(value, path):
        if isinstance(value, str):
            if value.strip().lower() == AUTO:
                return AUTO
            raise DeepSpeedConfigError(f"config key '{path}' must be \"auto\" or a positive integer, got {value!r}")
        return integer(minimum=1)(value, path)

    return parse


def _apply_after():

    def parse(value, path):
        if isinstance(value, str):
            if value.strip().lower() == "window":
                return "window"
            raise DeepSpeedConfigError(f"config key '{path}' must be \"window\" or a positive integer, got {value!r}")
        return integer(minimum=1)(value, path)

    return parse


@dataclasses.dataclass(frozen=True)
class ZenFlowConfig(ConfigSection):
    """Validated ``zero_optimization.zenflow`` settings (see the module docstring)."""
    topk_ratio: float = config_field(0.1, parse=number(minimum=0.0, maximum=1.0, exclusive_minimum=True))
    select_strategy: str = config_field("auto", parse=one_of(STRATEGIES))
    select_interval: Union[str, int] = config_field(AUTO, parse=_interval())
    update_interval: Union[str, int] = config_field(AUTO, parse=_interval())
    overlap_step: bool = config_field(False, parse=boolean())
    offload: bool = config_field(False, parse=boolean())
    auto_ratio: float = config_field(0.99, parse=number(minimum=0.0, maximum=1.0))
    full_warm_up_rounds: int = config_field(0, parse=integer(minimum=0))
    pt_reserved_cores_perc: float = config_field(0.5, parse=number(minimum=0.0, maximum=1.0))
    steps_per_epoch: Optional[int] = config_field(None, parse=optional(integer(minimum=1)))
    window_update: str = config_field("once", parse=one_of(WINDOW_UPDATES))
    overlap_apply_after: Union[str, int] = config_field("window", parse=_apply_after())

    @classmethod
    def _finalize(cls, values, spelled, path):
        strategy = values.get("select_strategy", "auto")
        interval = values.get("select_interval", AUTO)
        update = values.get("update_interval", AUTO)
        key = f"{path}.{spelled.get('select_interval', 'select_interval')}"
        if strategy != "auto" and interval == AUTO:
            raise DeepSpeedConfigError(f"config key '{path}.select_strategy' \"{strategy}\" needs a number for "
                                       f"'{key}' (how many {strategy}s between selections)")
        if strategy == "step" and update != AUTO and interval < update:
            raise DeepSpeedConfigError(f"config key '{key}' = {interval} is shorter than '{path}.update_interval' = "
                                       f"{update}: the selection can only change between host windows")
        return values


def parse_zenflow(raw, path="zero_optimization.zenflow"):
    """The :class:`ZenFlowConfig` of a raw ``zenflow`` mapping (None when absent)."""
    if raw is None:
        return None
    if isinstance(raw, ZenFlowConfig):
        return raw
    return ZenFlowConfig.from_dict(raw, path)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When ZenFlow selects and when a host window closes, in ZenFlow steps (upstream's rule, resolved from the
    config). A ZenFlow step is one ``engine.step()``: every micro-batch (see :func:`accumulation_steps`).

    ``select_every``: steps between selections, or None for "once" (an epoch strategy with no known epoch
    length); ``update_every``: steps per host window, or None for the "auto" rule.

    After ``warm_up`` full steps, step ``t`` selects when ``t == warm_up`` or ``t % select_every == 0``, and a
    window closes at step ``t`` when ``(t + 1 - warm_up) % update_every == 0`` or when the next step selects
    (``(t + 1) % select_every == 0``): a selection always starts a new window.
    """
    warm_up: int
    select_every: Optional[int]
    update_every: Optional[int]
    auto_ratio: float

    def selects(self, step, selected_before):
        """Whether step ``step`` (past the warm-up) selects; ``selected_before``: whether any selection was made."""
        if not selected_before:
            return True
        return bool(self.select_every) and step % self.select_every == 0

    def closes(self, step):
        """Whether the fixed window (or the next selection) closes the open window at step ``step``; with the
        "auto" update interval only the selection part (the rule decides the rest)."""
        if self.select_every and (step + 1) % self.select_every == 0:
            return True
        return self.update_every is not None and (step + 1 - self.warm_up) % self.update_every == 0


def resolve_schedule(cfg, steps_per_epoch=None):
    """The :class:`Schedule` of ``cfg``; ``steps_per_epoch`` (ZenFlow steps, i.e. micro-batches) comes from the
    training data."""
    epoch = cfg.steps_per_epoch or steps_per_epoch
    strategy, interval = cfg.select_strategy, cfg.select_interval
    if strategy == "auto":
        strategy, interval = "epoch", 1
    if strategy == "epoch":
        select_every = interval * epoch if epoch else None
    else:
        select_every = interval
    update_every = None if cfg.update_interval == AUTO else int(cfg.update_interval)
    return Schedule(warm_up=cfg.full_warm_up_rounds,
                    select_every=select_every,
                    update_every=update_every,
                    auto_ratio=cfg.auto_ratio)


def accumulation_steps(zenflow, gradient_accumulation_steps):
    """The engine's accumulation steps with ``zenflow`` (a :class:`ZenFlowConfig` or None): as upstream, every
    ``engine.step()`` is a ZenFlow step (the device part steps with that micro-batch's gradient) and the host
    window (``update_interval``) takes the place of gradient accumulation, so the engine accumulates over 1
    micro-batch; without ZenFlow, ``gradient_accumulation_steps``."""
    if zenflow is None:
        return gradient_accumulation_steps
    if gradient_accumulation_steps > 1:
        log_dist(
            f"zero_optimization.zenflow: every engine.step() is a ZenFlow step, as in upstream DeepSpeed; "
            f"gradient_accumulation_steps={gradient_accumulation_steps} is replaced by the host window "
            f"(update_interval), so each micro-batch's gradient is stepped on its own",
            ranks=[0],
            level=logging.WARNING)
    return 1


def window_on_device(cfg):
    """ZeRO 1/2: whether the stage keeps its gradient partitions on the device and ZenFlow's window sums there
    (``host_window.py``): unless ``zenflow.offload`` asks to keep the device's memory for the model (then the
    partitions and the window sum are on the host, at the cost of host passes every step). ZeRO-3 always sums on
    the host."""
    return not cfg.offload


def check_zenflow_stage(cfg, stage, offload_optimizer):
    """NotImplementedError / ValueError unless ZenFlow can run on this stage (a pure check: every rank raises)."""
    if cfg is None:
        return
    if cfg.select_strategy == "auto" and cfg.select_interval != AUTO:
        # the section parses (as upstream's); building the engine refuses it, as upstream's does
        raise DeepSpeedConfigError(f"config key 'zero_optimization.zenflow.select_interval' = {cfg.select_interval} "
                                   "needs 'zero_optimization.zenflow.select_strategy' \"step\" or \"epoch\": with "
                                   "strategy \"auto\" the selection is made once per epoch")
    if stage not in (1, 2, 3):
        raise ValueError(f"zero_optimization.zenflow needs ZeRO stage 1, 2 or 3, got stage {stage}")
    if offload_optimizer != "cpu":
        raise ValueError("zero_optimization.zenflow needs 'zero_optimization.offload_optimizer.device' \"cpu\": "
                         "the unselected part of the gradient is accumulated and stepped on the host")
