# SPDX-License-Identifier: Apache-2.0
"""The ``"pipeline"`` config section: upstream's keys and defaults, and this package's schedule choice.

Upstream's keys: ``stages`` (``"auto"``; the stages come from the module), ``partition`` (``"best"``; the module's
``partition_method`` decides), ``seed_layers``, ``activation_checkpoint_interval`` (overrides the module's when
> 0), ``use_reentrant`` (False selects non-reentrant activation checkpointing), ``pipe_partitioned`` and
``grad_partitioned`` (tensor-parallel activation partitioning; only meaningful with a model axis).

This package's keys:

* ``schedule``: ``"1f1b"`` (upstream's synchronous 1F1B, the default), ``"interleaved_1f1b"`` (each stage holds
  ``virtual_stages`` model chunks, round robin; the bubble shrinks by that factor) or ``"zero_bubble"``
  (ZB-H1: the backward is split into an input-gradient pass, sent upstream at once, and a weight-gradient
  pass that fills the bubbles; same memory as 1F1B). Every schedule gives the same gradients.
* ``virtual_stages``: model chunks per stage for ``"interleaved_1f1b"`` (default 2).

The parsed section is a plain dict (``engine._config.pipeline``), as upstream keeps it; unknown keys raise.
"""

from deepspeed.runtime.config_utils import DeepSpeedConfigError

SCHEDULES = {
    "1f1b": "1f1b",
    "interleaved_1f1b": "interleaved_1f1b",
    "interleaved": "interleaved_1f1b",
    "zero_bubble": "zero_bubble",
    "zb_h1": "zero_bubble",
    "zbh1": "zero_bubble",
}

DEFAULTS = {
    "stages": "auto",
    "partition": "best",
    "seed_layers": False,
    "activation_checkpoint_interval": 0,
    "pipe_partitioned": True,
    "grad_partitioned": True,
    "use_reentrant": True,
    "schedule": "1f1b",
    "virtual_stages": 2,
}


def _bool(key, value):
    if not isinstance(value, bool):
        raise DeepSpeedConfigError(f"config key 'pipeline.{key}' must be true or false, got {value!r}")
    return value


def _int(key, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DeepSpeedConfigError(f"config key 'pipeline.{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def get_pipeline_config(param_dict):
    """The ``pipeline`` section of a config dict, checked, with every default filled in (a dict)."""
    given = param_dict.get("pipeline") or {}
    if not isinstance(given, dict):
        raise DeepSpeedConfigError(f"config key 'pipeline' must be a dict, got {type(given).__name__}")
    unknown = sorted(k for k in given if k not in DEFAULTS)
    if unknown:
        raise DeepSpeedConfigError(f"unknown config keys {['pipeline.' + k for k in unknown]}; the 'pipeline' "
                                   f"section takes {sorted(DEFAULTS)}")
    config = dict(DEFAULTS)
    config.update(given)
    if config["stages"] != "auto":
        _int("stages", config["stages"], 1)
    if not isinstance(config["partition"], str):
        raise DeepSpeedConfigError(f"config key 'pipeline.partition' must be a string, got {config['partition']!r}")
    for key in ("seed_layers", "pipe_partitioned", "grad_partitioned"):
        _bool(key, config[key])
    if config["use_reentrant"] is not None:
        _bool("use_reentrant", config["use_reentrant"])
    _int("activation_checkpoint_interval", config["activation_checkpoint_interval"], 0)
    schedule = config["schedule"]
    if not isinstance(schedule, str) or schedule.lower() not in SCHEDULES:
        raise DeepSpeedConfigError(f"config key 'pipeline.schedule' must be one of {sorted(set(SCHEDULES))}, got "
                                   f"{schedule!r}")
    config["schedule"] = SCHEDULES[schedule.lower()]
    _int("virtual_stages", config["virtual_stages"], 1)
    return config
