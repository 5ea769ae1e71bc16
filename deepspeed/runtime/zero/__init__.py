# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.zero``: ZeRO stages, and the ZeRO-3 construction/gathering API."""

from deepspeed.runtime.zero.partition_parameters import GatheredParameters, Init  # noqa: F401
