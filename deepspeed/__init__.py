# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed-compatible training runtime whose gradients are right for every way backward is called."""

import argparse  # noqa: F401 (upstream's package namespace holds these)
import json  # noqa: F401
import os
import os as _os
import sys as _sys
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union  # noqa: F401

import torch  # noqa: F401
from packaging import version as pkg_version  # noqa: F401
from torch.nn import Parameter
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from deepspeed import comm  # noqa: F401
from deepspeed import ops  # noqa: F401
from deepspeed import utils  # noqa: F401
from deepspeed.accelerator import get_accelerator  # noqa: F401
from deepspeed.comm import init_distributed  # noqa: F401
from deepspeed.runtime import lr_schedules  # noqa: F401
from deepspeed.runtime import zero  # noqa: F401
from deepspeed.runtime.activation_checkpointing import checkpointing  # noqa: F401
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError  # noqa: F401
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: F401
from deepspeed.pipe import PipelineModule  # noqa: F401
from deepspeed.utils import OnDevice, log_dist, logger  # noqa: F401
from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer  # noqa: F401
from deepspeed.runtime.dataloader import DeepSpeedDataLoader  # noqa: F401
from deepspeed.runtime.tensor_parallel import init_utils as _tp_init_utils
from deepspeed.runtime.tensor_parallel.init_utils import tp_model_init  # noqa: F401
from deepspeed.runtime.tensor_parallel.init_utils import (  # noqa: F401
    load_ds_config, merge_tp_model_init_into_config, record_tp_model_init_args)
from deepspeed.runtime.pipe.engine import PipelineEngine  # noqa: F401
from deepspeed.runtime.constants import MUON_OPTIMIZER  # noqa: F401
from deepspeed import constants  # noqa: F401
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT  # noqa: F401
from deepspeed.module_inject.layers import set_autotp_mode  # noqa: F401
from deepspeed import comm as dist  # noqa: F401
from deepspeed import module_inject, profiling  # noqa: F401
from deepspeed import top_level as _top_level

# upstream's type aliases of what initialize takes for an optimizer and a scheduler
DeepSpeedOptimizerCallable = Callable[[Union[Iterable[Parameter], Dict[str, Iterable]]], Optimizer]
DeepSpeedSchedulerCallable = Callable[[Optimizer], LRScheduler]

# upstream's per-head Muon classification labels (per-head Muon itself is not built: see top_level.py)
QUERY, KV, MLA_Q, MLA_KV, NOT_HEAD_BLOCKED = "query", "kv", "mla_q", "mla_kv", "not-head-blocked"


def __getattr__(name):
    if name in ("git_hash", "git_branch", "git_version_info"):  # computed on first access (runs git)
        import importlib
        git_version_info = importlib.import_module("deepspeed.git_version_info")
        return git_version_info if name == "git_version_info" else getattr(git_version_info, name)
    error = _top_level.not_built(name)
    if error is not None:
        raise error
    raise AttributeError(f"module 'deepspeed' has no attribute '{name}'")


# `import deepspeed.checkpointing` works too, not only the attribute.
_sys.modules.setdefault(__name__ + ".checkpointing", checkpointing)


def _read_version():
    try:
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("deepspeed")
        except PackageNotFoundError:
            pass
    except ImportError:
        pass
    path = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "version.txt")
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return "0.19.9+rbc"


__version__ = _read_version()
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in __version__.split("+")[0].split(".")[:3])
__git_hash__ = None
__git_branch__ = None
version = __version__


def initialize(args=None,
               model=None,
               optimizer=None,
               model_parameters=None,
               training_data=None,
               lr_scheduler=None,
               distributed_port=29500,
               mpu=None,
               dist_init_required=None,
               collate_fn=None,
               config=None,
               mesh_param=None,
               config_params=None):
    """Wrap ``model`` for training; returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    The config comes from ``config``, ``config_params`` (its older name) or
    ``args.deepspeed_config`` (``args.deepscale_config``, deprecated), as a dict or a JSON path.
    ``optimizer`` is a torch optimizer or a callable(params); ``lr_scheduler`` a scheduler or a
    callable(optimizer). Without an optimizer (and no config ``optimizer``) the engine
    is for evaluation.
    """
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
        if config is None and getattr(args, "deepscale_config", None) is not None:
            # upstream's deprecated spelling, still read (with its warning)
            logger.warning("args.deepscale_config is deprecated; use args.deepspeed_config (or config=)")
            config = args.deepscale_config
    if config is None:
        raise ValueError("deepspeed.initialize: no config given (pass config=dict/path, or args.deepspeed_config)")
    if not comm.is_initialized():
        comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    # what tp_model_init recorded fills the config's tensor_parallel section (a conflict raises)
    config = _tp_init_utils.merged_config(config, mpu, mesh_param, comm)
    if isinstance(model, PipelineModule):  # pipeline parallelism: a PipelineEngine (docs/pipeline.md)
        from deepspeed.runtime.pipe.engine import initialize_pipeline
        returned = initialize_pipeline(args, model, optimizer, model_parameters, training_data, lr_scheduler, mpu,
                                       dist_init_required, collate_fn, config)
        returned[0]._configure_python_gc()  # disable_python_gc, as upstream: once the engine is built
        return returned
    engine = DeepSpeedEngine(args=args,
                             model=model,
                             optimizer=optimizer,
                             model_parameters=model_parameters,
                             training_data=training_data,
                             lr_scheduler=lr_scheduler,
                             mpu=mpu,
                             dist_init_required=dist_init_required,
                             collate_fn=collate_fn,
                             config=config)
    engine._configure_python_gc()  # disable_python_gc, as upstream: once the engine is built
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def add_config_arguments(parser):
    """Add ``--deepspeed`` and ``--deepspeed_config`` to an argparse parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="Enable DeepSpeed")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    return parser


def default_inference_config():
    raise NotImplementedError("DeepSpeed inference is not part of this runtime; see docs/compatibility.md")


def init_inference(*args, **kwargs):
    raise NotImplementedError("deepspeed.init_inference is not part of this runtime; see docs/compatibility.md")
