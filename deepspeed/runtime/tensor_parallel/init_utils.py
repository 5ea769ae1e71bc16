# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.tp_model_init`` and how what it records merges into the config at ``initialize`` (upstream's rules).

``tp_model_init(model, tp_size, dtype, config=None, tp_group=None)`` cuts nothing: it records
``tp_size``, ``dtype`` and ``tp_group``, turns AutoTP training mode on and returns the model;
``deepspeed.initialize`` cuts it. At ``initialize`` the config is canonical and the recorded
arguments fill what it leaves out:

* ``tensor_parallel.autotp_size`` (and ``tensor_parallel.tp.tp_size``): filled from ``tp_size``;
  a different value raises;
* the training dtype (``bf16`` / ``fp16`` enabled) and ``tensor_parallel.dtype``: a value other
  than ``dtype`` raises;
* ``tp_group``: its size must be ``tp_size``; a ``tp_group`` together with an ``mpu`` raises
  (two sources of tensor-parallel groups); without either the groups are made from the world.

Two ``tp_model_init`` calls with different arguments raise. Every check is local: the same
error on every rank, before any collective.
"""

import copy

import torch

from deepspeed.runtime.config_utils import DTYPE_SPELLINGS, load_config

_TP_MODEL_INIT_ARGS = None


def load_ds_config(config):
    """The config as a fresh dict, from a dict or a path to a JSON file."""
    return load_config(config)


def _group_size(group, dist_module):
    if group is None or dist_module is None or not dist_module.is_initialized():
        return None
    return dist_module.get_world_size(group=group)


def record_tp_model_init_args(tp_size, dtype, tp_group, dist_module):
    """Record one ``tp_model_init`` call; ValueError when an earlier call recorded other arguments."""
    global _TP_MODEL_INIT_ARGS
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be a positive int, got {tp_size!r}")
    new = {"tp_size": tp_size, "dtype": dtype, "tp_group": tp_group}
    old = _TP_MODEL_INIT_ARGS
    if old is not None:
        same_group = (old["tp_group"] is None) == (tp_group is None) and (_group_size(old["tp_group"], dist_module)
                                                                          == _group_size(tp_group, dist_module))
        if old["tp_size"] != tp_size or old["dtype"] != dtype or not same_group:
            raise ValueError(
                f"Conflicting tp_model_init arguments detected across multiple calls: "
                f"(tp_size={old['tp_size']}, dtype={old['dtype']}) and (tp_size={tp_size}, dtype={dtype})")
        return
    _TP_MODEL_INIT_ARGS = new


def recorded_args():
    """What ``tp_model_init`` recorded (None when it was not called)."""
    return _TP_MODEL_INIT_ARGS


def reset():
    """Forget what ``tp_model_init`` recorded."""
    global _TP_MODEL_INIT_ARGS
    _TP_MODEL_INIT_ARGS = None


def infer_config_dtype(config_dict):
    """The training dtype a config dict enables (None: fp32, or not decided yet)."""
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        section = config_dict.get(key)
        if isinstance(section, dict) and section.get("enabled", False) is True:
            return dtype
    return None


def _as_dtype(value):
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        return DTYPE_SPELLINGS.get(value.lower())
    return None


def merge_tp_model_init_into_config(config_dict, mpu, mesh_param, dist_module):
    """Merge what ``tp_model_init`` recorded into ``config_dict`` (in place; module docstring for the rules)."""
    args = _TP_MODEL_INIT_ARGS
    if args is None:
        return config_dict
    tp_size, dtype, tp_group = args["tp_size"], args["dtype"], args["tp_group"]
    if tp_group is not None and mpu is not None:
        raise ValueError("tp_model_init provided tp_group; deepspeed.initialize must not receive mpu.")
    section = config_dict.get("tensor_parallel")
    if section is None:
        section = config_dict["tensor_parallel"] = {}
    if not isinstance(section, dict):
        raise ValueError(f"config key 'tensor_parallel' must be a dict, got {type(section).__name__}")
    configured = section.get("autotp_size")
    if configured is not None and configured != tp_size:
        raise ValueError(f"Conflicting tensor_parallel.autotp_size in config ({configured}) and tp_model_init "
                         f"({tp_size}).")
    if configured is None:
        section["autotp_size"] = tp_size
    tp = section.get("tp", section.get("tensor_parallel")) or {}
    if not isinstance(tp, dict):
        raise ValueError("tensor_parallel.tp must be a dict when provided.")
    if tp.get("tp_size") is not None and tp["tp_size"] != tp_size:
        raise ValueError(f"Conflicting tensor_parallel.tp.tp_size in config ({tp['tp_size']}) and tp_model_init "
                         f"({tp_size}).")
    if tp_group is not None:
        size = _group_size(tp_group, dist_module)
        if size is not None and size != tp_size:
            raise ValueError(f"tp_model_init tp_size ({tp_size}) does not match tp_group size ({size}).")
    config_dtype = infer_config_dtype(config_dict)
    if config_dtype is not None and dtype is not None and config_dtype != dtype:
        raise ValueError(f"Conflicting dtype: config uses {config_dtype} but tp_model_init requested {dtype}.")
    if section.get("dtype") is not None:
        tp_dtype = _as_dtype(section["dtype"])
        if tp_dtype is not None and dtype is not None and tp_dtype != dtype:
            raise ValueError(f"Conflicting tensor_parallel.dtype in config ({section['dtype']}) and tp_model_init "
                             f"({dtype}).")
    elif isinstance(dtype, torch.dtype):
        section["dtype"] = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, "fp16")
    return config_dict


def merged_config(config, mpu=None, mesh_param=None, dist_module=None):
    """``config`` (a dict or a path) as a fresh dict with ``tp_model_init``'s arguments merged in; the config
    itself when nothing was recorded (so that a path stays a path)."""
    if _TP_MODEL_INIT_ARGS is None:
        return config
    config_dict = copy.deepcopy(config) if isinstance(config, dict) else load_ds_config(config)
    return merge_tp_model_init_into_config(config_dict, mpu, mesh_param, dist_module)


def tp_model_init(model, tp_size, dtype, config=None, **kwargs):
    """Record the tensor-parallel arguments of ``model`` for ``deepspeed.initialize``, which cuts it (module
    docstring). ``config`` (a dict or a path), when given, is checked against them now. Returns ``model``."""
    import deepspeed.comm as dist
    from deepspeed.module_inject.layers import set_autotp_mode
    unknown = sorted(set(kwargs) - {"tp_group"})
    if unknown:
        raise TypeError(f"tp_model_init: unexpected keyword arguments {unknown}")
    record_tp_model_init_args(tp_size=tp_size, dtype=dtype, tp_group=kwargs.get("tp_group"), dist_module=dist)
    if config is not None:
        merged_config(config, dist_module=dist)
    set_autotp_mode(training=True)
    return model
