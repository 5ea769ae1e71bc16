# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.monitor``: training events written to TensorBoard, CSV files, Weights & Biases or Comet."""

from .config import CometConfig, CSVConfig, DeepSpeedMonitorConfig, TensorBoardConfig, WandbConfig, get_monitor_config
from .monitor import Monitor, MonitorMaster

__all__ = [
    "CometConfig", "CSVConfig", "DeepSpeedMonitorConfig", "TensorBoardConfig", "WandbConfig", "get_monitor_config",
    "Monitor", "MonitorMaster"
]
