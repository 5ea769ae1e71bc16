# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.profiling``: the flops profiler."""
