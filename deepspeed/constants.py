# SPDX-License-Identifier: Apache-2.0
"""Package-wide constants under upstream's names (``deepspeed.constants``)."""

from deepspeed.comm.comm import DEFAULT_PG_TIMEOUT as default_pg_timeout  # noqa: F401 (DEEPSPEED_TIMEOUT minutes)

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

INFERENCE_GENERIC_MODE = "generic"
INFERENCE_SPECIALIZED_MODE = "specialized"

CROSS_RANK = "CROSS_RANK"
CROSS_SIZE = "CROSS_SIZE"
LOCAL_RANK = "LOCAL_RANK"
