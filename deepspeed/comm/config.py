# SPDX-License-Identifier: Apache-2.0
"""The ``comms_logger`` section of the config (upstream's keys and defaults)."""

import dataclasses
from typing import Tuple

from deepspeed.runtime.config_utils import ConfigSection, boolean, config_field, string_list

COMMS_LOGGER = "comms_logger"


@dataclasses.dataclass(frozen=True)
class CommsLoggerConfig(ConfigSection):
    """``enabled``: log collectives; ``prof_all``: every collective, else only those named in ``prof_ops``
    (e.g. ``["all_reduce", "all_gather_into_tensor"]``); ``verbose``: one line per collective as it completes;
    ``debug``: record each collective under its caller's function name too."""
    enabled: bool = config_field(False, parse=boolean())
    verbose: bool = config_field(False, parse=boolean())
    prof_all: bool = config_field(True, parse=boolean())
    prof_ops: Tuple[str, ...] = config_field((), parse=string_list())
    debug: bool = config_field(False, parse=boolean())


class DeepSpeedCommsConfig:
    """Upstream's holder: ``comms_logger_enabled`` and ``comms_logger`` (a :class:`CommsLoggerConfig`)."""

    def __init__(self, param_dict):
        self.comms_logger = CommsLoggerConfig.from_dict((param_dict or {}).get(COMMS_LOGGER), COMMS_LOGGER)
        self.comms_logger_enabled = self.comms_logger.enabled
