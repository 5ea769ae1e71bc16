# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``PipelinedOptimizerSwapper`` (NVMe tensor swapping): not built; constructing it raises
``NotImplementedError``."""

from deepspeed.runtime.not_built import not_built_class

PipelinedOptimizerSwapper = not_built_class("PipelinedOptimizerSwapper", "NVMe tensor swapping", module=__name__)
