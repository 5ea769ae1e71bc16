# SPDX-License-Identifier: Apache-2.0
"""Tools for the disk tier (upstream's ``deepspeed.nvme``): ``ds_io`` measures the aio handle's read and write
throughput on a folder; ``ds_nvme_tune`` sweeps its settings and prints the ``aio`` config section that was
fastest (docs/offload.md)."""

from .ds_io import ds_io_main, measure  # noqa: F401
from .tune import generate_main, main as nvme_tune_main, parse_sweep_arguments, sweep_main  # noqa: F401
