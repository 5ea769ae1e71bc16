# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``AsyncTensorSwapper`` (NVMe tensor swapping): not built; constructing it raises
``NotImplementedError``."""

from deepspeed.runtime.not_built import not_built_class

AsyncTensorSwapper = not_built_class("AsyncTensorSwapper", "NVMe tensor swapping", module=__name__)
