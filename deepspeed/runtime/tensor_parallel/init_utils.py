# SPDX-License-Identifier: Apache-2.0
"""Upstream's AutoTP initialisation helpers. ``load_ds_config`` (a config dict from a dict or a JSON path) is
built; the tensor-parallel ones raise ``NotImplementedError``."""

from deepspeed.runtime.config_utils import load_config
from deepspeed.runtime.not_built import not_built_function

_FEATURE = "automatic tensor parallelism (AutoTP)"


def load_ds_config(config):
    """The config as a fresh dict, from a dict or a path to a JSON file."""
    return load_config(config)


record_tp_model_init_args = not_built_function("record_tp_model_init_args", _FEATURE, module=__name__)
merge_tp_model_init_into_config = not_built_function("merge_tp_model_init_into_config", _FEATURE, module=__name__)
tp_model_init = not_built_function("tp_model_init", _FEATURE, module=__name__)
