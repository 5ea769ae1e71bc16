# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``TpTrainingManager`` (AutoTP training): not built."""

from deepspeed.runtime.not_built import not_built_class

TpTrainingManager = not_built_class("TpTrainingManager", "automatic tensor parallelism (AutoTP)", module=__name__)
