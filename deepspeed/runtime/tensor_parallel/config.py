# SPDX-License-Identifier: Apache-2.0
"""The ``tensor_parallel`` section: AutoTP is not built, so only "no tensor parallelism" is accepted."""

from enum import Enum


class AUTOTP_MODE(Enum):
    TRAINING = "TRAINING"
    INFERENCE = "INFERENCE"


def get_tensor_parallel_config(ds_config):
    """None when the config asks for no tensor parallelism (no section, or ``autotp_size`` <= 1); otherwise
    ``NotImplementedError``, by the row of ``deepspeed/runtime/config_audit.py`` that refuses the section."""
    from deepspeed.runtime.config_audit import NOT_BUILT, refusal
    message = refusal(ds_config, [row for row in NOT_BUILT
                                  if row.key == "tensor_parallel"]) if isinstance(ds_config, dict) else None
    if message is not None:
        raise NotImplementedError(message)
    return None
