# SPDX-License-Identifier: Apache-2.0
"""The ``tensor_parallel`` section: AutoTP is not built, so only "no tensor parallelism" is accepted."""

from enum import Enum


class AUTOTP_MODE(Enum):
    TRAINING = "TRAINING"
    INFERENCE = "INFERENCE"


def get_tensor_parallel_config(ds_config):
    """None when the config asks for no tensor parallelism (no section, or ``autotp_size`` <= 1); otherwise
    ``NotImplementedError``."""
    section = ds_config.get("tensor_parallel") if isinstance(ds_config, dict) else None
    size = (section or {}).get("autotp_size", (section or {}).get("tp_size", 1))
    if size is not None and int(size) > 1:
        raise NotImplementedError("automatic tensor parallelism (tensor_parallel.autotp_size > 1) is not built in "
                                  "this runtime; see docs/compatibility.md")
    return None
