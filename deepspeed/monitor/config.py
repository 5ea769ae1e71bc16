# SPDX-License-Identifier: Apache-2.0
"""The monitor sections of the config: ``tensorboard``, ``csv_monitor``, ``wandb`` and ``comet``.

Keys and defaults are upstream's. Each section is a typed :class:`ConfigSection`, so an unknown key or a value
of the wrong type raises :class:`DeepSpeedConfigError` naming the key, on every rank, while the config is parsed
(no collectives). Whether an output path is writable or an optional package is installed is checked later, when
the engine builds its monitors (see :mod:`deepspeed.monitor.monitor`).
"""

import dataclasses
from typing import Optional

from deepspeed.runtime.config_utils import (ConfigSection, DeepSpeedConfigError, boolean, config_field,
                                            filesystem_path, integer, one_of, optional, string)

TENSORBOARD = "tensorboard"
CSV_MONITOR = "csv_monitor"
WANDB = "wandb"
COMET = "comet"
MONITOR_SECTIONS = (TENSORBOARD, CSV_MONITOR, WANDB, COMET)
DEFAULT_JOB_NAME = "DeepSpeedJobName"


@dataclasses.dataclass(frozen=True)
class TensorBoardConfig(ConfigSection):
    """Event files under ``<output_path>/<job_name>/`` (``output_path`` empty: the current directory)."""
    enabled: bool = config_field(False, parse=boolean())
    output_path: str = config_field("", parse=filesystem_path())
    job_name: str = config_field(DEFAULT_JOB_NAME, parse=string())


@dataclasses.dataclass(frozen=True)
class CSVConfig(ConfigSection):
    """One ``<event name>.csv`` per event under ``<output_path>/<job_name>/``."""
    enabled: bool = config_field(False, parse=boolean())
    output_path: str = config_field("", parse=filesystem_path())
    job_name: str = config_field(DEFAULT_JOB_NAME, parse=string())


@dataclasses.dataclass(frozen=True)
class WandbConfig(ConfigSection):
    """A Weights & Biases run: ``wandb.init(project=project, group=group, entity=team)``."""
    enabled: bool = config_field(False, parse=boolean())
    group: Optional[str] = config_field(None, parse=optional(string()))
    team: Optional[str] = config_field(None, parse=optional(string()))
    project: str = config_field("deepspeed", parse=string())


@dataclasses.dataclass(frozen=True)
class CometConfig(ConfigSection):
    """A Comet experiment (``comet_ml.start``); a metric is sent at most every ``samples_log_interval`` samples."""
    enabled: bool = config_field(False, parse=boolean())
    samples_log_interval: int = config_field(100, parse=integer(minimum=1))
    project: Optional[str] = config_field(None, parse=optional(string()))
    workspace: Optional[str] = config_field(None, parse=optional(string()))
    api_key: Optional[str] = config_field(None, parse=optional(string()))
    experiment_name: Optional[str] = config_field(None, parse=optional(string()))
    experiment_key: Optional[str] = config_field(None, parse=optional(string()))
    online: Optional[bool] = config_field(None, parse=optional(boolean()))
    mode: Optional[str] = config_field(None, parse=optional(one_of(("get", "create", "get_or_create"))))


@dataclasses.dataclass(frozen=True)
class DeepSpeedMonitorConfig:
    """All monitor sections; ``enabled`` is true when any of them is."""
    tensorboard: TensorBoardConfig = dataclasses.field(default_factory=TensorBoardConfig)
    csv_monitor: CSVConfig = dataclasses.field(default_factory=CSVConfig)
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    comet: CometConfig = dataclasses.field(default_factory=CometConfig)

    @property
    def enabled(self) -> bool:
        return any(section.enabled for section in (self.tensorboard, self.csv_monitor, self.wandb, self.comet))


def get_monitor_config(param_dict: dict) -> DeepSpeedMonitorConfig:
    """Parse the four monitor sections of a config dict (an absent or null section takes the defaults)."""
    if not isinstance(param_dict, dict):
        raise DeepSpeedConfigError(f"the DeepSpeed config must be a dict, got {type(param_dict).__name__}")
    return DeepSpeedMonitorConfig(tensorboard=TensorBoardConfig.from_dict(param_dict.get(TENSORBOARD), TENSORBOARD),
                                  csv_monitor=CSVConfig.from_dict(param_dict.get(CSV_MONITOR), CSV_MONITOR),
                                  wandb=WandbConfig.from_dict(param_dict.get(WANDB), WANDB),
                                  comet=CometConfig.from_dict(param_dict.get(COMET), COMET))
