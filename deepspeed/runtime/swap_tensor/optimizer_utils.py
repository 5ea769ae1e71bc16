# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``OptimizerSwapper`` (NVMe tensor swapping): not built; constructing it raises
``NotImplementedError``."""

from deepspeed.runtime.not_built import not_built_class

OptimizerSwapper = not_built_class("OptimizerSwapper", "NVMe tensor swapping", module=__name__)
FlattenedTensorSwapInfo = not_built_class("FlattenedTensorSwapInfo", "NVMe tensor swapping", module=__name__)
SwapTensorContext = not_built_class("SwapTensorContext", "NVMe tensor swapping", module=__name__)
OptimizerStateSwapInfo = not_built_class("OptimizerStateSwapInfo", "NVMe tensor swapping", module=__name__)
