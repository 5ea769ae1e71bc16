# SPDX-License-Identifier: Apache-2.0
"""The ``fp16`` section refuses every value upstream 0.19.8 refuses, and reads the values it accepts alike.

``UPSTREAM`` is what upstream's ``DeepSpeedFP16Config(**{key: value})`` does with each value (recorded from
0.19.8 on torch 2.13; a number is the value it stores, ``REFUSED`` a validation error), in each of three settings:
dynamic loss scaling (``enabled``, ``loss_scale`` 0), a static scale (``loss_scale`` 128) and fp16 off. Every
value is tried through keyword construction and through a whole config dict; the refusals must name the key.
``STRICTER`` lists where this runtime refuses what upstream takes (docs/compatibility.md says why).
"""

import math

import pytest

from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.config_utils import DeepSpeedConfigError
from deepspeed.runtime.precision_config import DeepSpeedFP16Config

REFUSED = "refused"
INF, NAN = float("inf"), float("nan")
SETTINGS = {"dynamic": dict(enabled=True, loss_scale=0), "static": dict(enabled=True, loss_scale=128), "off": {}}
NOT_NUMBERS = [None, "abc", "", "true", [], {}, INF, -INF, NAN]
INTEGER_KEYS = ("initial_scale_power", "hysteresis", "loss_scale_window", "min_loss_scale")
SWITCHES = ("enabled", "auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads")


def _everywhere(pairs):
    """``[(value, {setting: result})]`` for results that do not depend on the setting (a list: 1, 1.0 and True are
    different values here, and equal dict keys)."""
    return [(value, {setting: result for setting in SETTINGS}) for value, result in pairs]


def _upstream():
    table = {}
    table["loss_scale"] = _everywhere([(0, 0.0), (1, 1.0), (2.5, 2.5), (0.5, 0.5), (1e9, 1e9), ("3", 3.0), (
        "3.5", 3.5), (-1, REFUSED), (-0.5, REFUSED), (True, REFUSED), (False, REFUSED)] + [(v, REFUSED)
                                                                                           for v in NOT_NUMBERS])
    for key in INTEGER_KEYS:
        common = [(1, 1), (2.0, 2), (1024, 1024), ("3", 3), (2.5, REFUSED), (0.5, REFUSED), ("3.5", REFUSED)]
        table[key] = _everywhere(common + [(v, REFUSED) for v in NOT_NUMBERS])
    for key in ("loss_scale_window", "min_loss_scale"):  # refused while dynamic scaling reads them
        table[key] += [(value, dict(dynamic=REFUSED, static=value, off=value)) for value in (0, -1, -2000)]
        table[key] += _everywhere([(True, REFUSED), (False, REFUSED)])
    table["hysteresis"] += _everywhere([(0, 0), (-1, -1), (-2000, -2000)])
    table["initial_scale_power"] += _everywhere([(0, 0), (-1, -1), (-2000, -2000), (1025, 1025)])
    for key in ("hysteresis", "initial_scale_power"):
        table[key] += _everywhere([(True, 1), (False, 0)])
    for key in SWITCHES:
        table[key] = _everywhere([(True, True), (False, False), (0, False), (1, True), ("true", True), (1.0, True),
                                  (-1, REFUSED), (2.0, REFUSED), ("3", REFUSED), ("abc", REFUSED), (None, REFUSED),
                                  (INF, REFUSED), ([], REFUSED)])
    return table


UPSTREAM = _upstream()


def _stricter(key, value, setting):
    """Values refused here that upstream accepts."""
    if key in SWITCHES:  # switches are bools in every section here
        return not isinstance(value, bool)
    if isinstance(value, bool):
        return key in ("hysteresis", "initial_scale_power")  # upstream refuses bools in the other numeric keys
    if setting == "dynamic" and key == "hysteresis":
        return value in (0, -1, -2000)  # upstream never lowers the scale then
    if setting == "dynamic" and key == "initial_scale_power":
        return value in (-2000, 1024, 1025
                         )  # 2 ** power is no finite positive float (upstream fails at the first step)
    return False


def _keyword(key, value, setting):
    kwargs = dict(SETTINGS[setting])
    kwargs[key] = value
    return getattr(DeepSpeedFP16Config(**kwargs), key)


def _from_dict(key, value, setting):
    section = dict(SETTINGS[setting])
    section[key] = value
    config = {"train_batch_size": 1, "fp16": section, "zero_optimization": {"stage": 1}}
    return getattr(DeepSpeedConfig(config, world_size=1).float16_config, key)


@pytest.mark.parametrize("key", list(UPSTREAM))
def test_fp16_values_as_upstream(key):
    for value, by_setting in UPSTREAM[key]:
        for setting, expected in by_setting.items():
            refused = expected is REFUSED or _stricter(key, value, setting)
            for build in (_keyword, _from_dict):
                case = (key, value, setting, build.__name__)
                if refused:
                    with pytest.raises(DeepSpeedConfigError, match=f"fp16.{key}"):
                        build(key, value, setting)
                    continue
                got = build(key, value, setting)
                assert got == expected and type(got) is type(expected), (case, got)


def test_upstream_messages_and_types():
    with pytest.raises(ValueError, match="must be a number"):  # upstream's words for a list or a dict
        DeepSpeedFP16Config(loss_scale=[])
    cfg = DeepSpeedFP16Config(enabled=True, loss_scale="3", loss_scale_window=-1, min_loss_scale=0)
    assert cfg.loss_scale == 3.0 and not cfg.dynamic_loss_scale and cfg.loss_scale_window == -1
    assert math.isinf(DeepSpeedFP16Config(initial_scale_power=2000).initial_dynamic_scale())  # unused: accepted
