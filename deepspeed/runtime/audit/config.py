# SPDX-License-Identifier: Apache-2.0
"""The ``gradient_audit`` config section: when the engine checks its own gradient during training.

    "gradient_audit": {
        "enabled": false,        # run the audit at accumulation boundaries
        "every_n_steps": 1000,   # audit optimizer steps 0, n, 2n, ... (global_steps % n == 0)
        "directions": 4,         # random directions per audit (2 forward passes of the window each)
        "tolerance": null,       # largest accepted relative error; null: by the model dtype (see report.py)
        "on_mismatch": "warn"    # "warn" or "raise", on every rank alike
    }

Parsing is local (no collectives), so a bad value raises the same error on every rank. Unknown keys raise.
"""

import dataclasses
from typing import Optional

from deepspeed.runtime.config_utils import ConfigSection, boolean, config_field, integer, number, one_of, optional

GRADIENT_AUDIT = "gradient_audit"
ON_MISMATCH = ("warn", "raise")


@dataclasses.dataclass(frozen=True)
class GradientAuditConfig(ConfigSection):
    """See the module docstring."""
    enabled: bool = config_field(False, parse=boolean())
    every_n_steps: int = config_field(1000, parse=integer(minimum=1))
    directions: int = config_field(4, parse=integer(minimum=1))
    tolerance: Optional[float] = config_field(None, parse=optional(number(minimum=0.0, exclusive_minimum=True)))
    on_mismatch: str = config_field("warn", parse=one_of(ON_MISMATCH))


def get_gradient_audit_config(param_dict: dict) -> GradientAuditConfig:
    """The parsed ``gradient_audit`` section of ``param_dict`` (defaults when absent or null)."""
    return GradientAuditConfig.from_dict(param_dict.get(GRADIENT_AUDIT), GRADIENT_AUDIT)
