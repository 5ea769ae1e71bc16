# SPDX-License-Identifier: Apache-2.0
"""The ``flops_profiler`` section of the config (upstream's keys and defaults)."""

import dataclasses
from typing import Optional

from deepspeed.runtime.config_utils import (ConfigSection, boolean, config_field, filesystem_path, integer, number,
                                            optional)

FLOPS_PROFILER = "flops_profiler"


@dataclasses.dataclass(frozen=True)
class DeepSpeedFlopsProfilerConfig(ConfigSection):
    """``profile_step``: the global step (optimizer steps completed before it) whose forwards are profiled;
    ``module_depth``: how deep the detailed profile goes (-1: all); ``top_modules``: how many modules the aggregated
    profile lists per depth; ``detailed``: print the per-module tree; ``output_file``: write there instead of
    stdout; ``recompute_fwd_factor``: the share of the forward recomputed in backward (activation checkpointing:
    1.0), added to the backward's flops."""
    enabled: bool = config_field(False, parse=boolean())
    recompute_fwd_factor: float = config_field(0.0, parse=number(minimum=0.0))
    profile_step: int = config_field(1, parse=integer(minimum=0))
    module_depth: int = config_field(-1, parse=integer(minimum=-1))
    top_modules: int = config_field(1, parse=integer(minimum=1))
    detailed: bool = config_field(True, parse=boolean())
    output_file: Optional[str] = config_field(None, parse=optional(filesystem_path()))


def get_flops_profiler_config(param_dict):
    return DeepSpeedFlopsProfilerConfig.from_dict(param_dict.get(FLOPS_PROFILER), FLOPS_PROFILER)
