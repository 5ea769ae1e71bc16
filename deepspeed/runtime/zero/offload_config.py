# SPDX-License-Identifier: Apache-2.0
"""The ``offload_optimizer`` and ``offload_param`` sections of ``zero_optimization``.

Keys and defaults are upstream's. ``device`` is ``"none"``, ``"cpu"`` or ``"nvme"``; ``"nvme"``
requires ``nvme_path``. NVMe-specific keys (buffer counts and sizes, pipelining) are validated and
kept so configs round-trip, whether or not the runtime uses them.
"""

import dataclasses
from enum import Enum
from typing import Optional

from ..config_utils import (ConfigSection, DeepSpeedConfigError, boolean, config_field, integer, number, one_of,
                            optional, filesystem_path, size)


class OffloadDeviceEnum(str, Enum):
    """Where offloaded state lives. A ``str`` enum, so ``device == "cpu"`` works."""
    none = "none"
    cpu = "cpu"
    nvme = "nvme"

    def __str__(self):
        return self.value


class OffloadStateTypeEnum(str, Enum):
    """The engine states ``engine.offload_states(include=...)`` names (upstream's members and values)."""
    optim_states = "optim_states"  # the optimizer's state (Adam's moments)
    hp_params = "hp_params"  # the fp32 master parameters
    lp_params = "lp_params"  # the model's (16-bit) parameters or ZeRO-3 shards
    lp_grads = "lp_grads"  # the window gradient (its partitions)
    contiguous_grad_buffer = "contiguous_grad_buffer"  # staging buffers of the gradient reduction


_device = one_of([device.value for device in OffloadDeviceEnum], convert=OffloadDeviceEnum)


def _require_nvme_path(values: dict, path: str) -> None:
    if values.get("device") == OffloadDeviceEnum.nvme and values.get("nvme_path") is None:
        raise DeepSpeedConfigError(f"config key '{path}.nvme_path' is required when '{path}.device' is 'nvme'")


@dataclasses.dataclass(frozen=True)
class DeepSpeedZeroOffloadParamConfig(ConfigSection):
    """Parameter offload (ZeRO stage 3 only)."""
    device: OffloadDeviceEnum = config_field(OffloadDeviceEnum.none, parse=_device)
    nvme_path: Optional[str] = config_field(None, parse=optional(filesystem_path()))
    buffer_count: int = config_field(5, parse=integer(minimum=0))
    buffer_size: int = config_field(int(1e8), parse=size())
    max_in_cpu: int = config_field(int(1e9), parse=size())
    pin_memory: bool = config_field(True, parse=boolean())  # upstream 0.19's default

    @classmethod
    def _finalize(cls, values, spelled, path):
        _require_nvme_path(values, path)
        return values


@dataclasses.dataclass(frozen=True)
class DeepSpeedZeroOffloadOptimizerConfig(ConfigSection):
    """Optimizer-state offload (ZeRO stages 1, 2 and 3); ``ratio < 1`` (partial offload) is stage 3 only."""
    device: OffloadDeviceEnum = config_field(OffloadDeviceEnum.none, parse=_device)
    nvme_path: Optional[str] = config_field(None, parse=optional(filesystem_path()))
    buffer_count: int = config_field(4, parse=integer(minimum=0))
    pin_memory: bool = config_field(True, parse=boolean())  # upstream 0.19's default
    pipeline_read: bool = config_field(False, parse=boolean())
    pipeline_write: bool = config_field(False, parse=boolean())
    fast_init: bool = config_field(False, parse=boolean())
    ratio: float = config_field(1.0, parse=number(minimum=0.0, maximum=1.0))
    super_offload: bool = config_field(False, parse=boolean())
    convert_grad_on_cpu: bool = config_field(True, parse=boolean())
    cpuadam_cores_perc: float = config_field(0.8, parse=number(minimum=0.0, maximum=1.0))

    @classmethod
    def _finalize(cls, values, spelled, path):
        _require_nvme_path(values, path)
        return values

    @property
    def pipeline(self) -> bool:
        """True when NVMe reads or writes are pipelined with the optimizer step."""
        return self.pipeline_read or self.pipeline_write
