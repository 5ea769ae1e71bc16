# SPDX-License-Identifier: Apache-2.0
"""Per-module flops, parameters and latency of a model's forward, on ``torch.utils.flop_counter``."""

from .profiler import FlopsProfiler, get_model_profile  # noqa: F401
