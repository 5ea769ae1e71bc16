# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``PartitionedOptimizerSwapper`` (NVMe tensor swapping): not built; constructing it raises
``NotImplementedError``."""

from deepspeed.runtime.not_built import not_built_class

PartitionedOptimizerSwapper = not_built_class("PartitionedOptimizerSwapper", "NVMe tensor swapping", module=__name__)
