# SPDX-License-Identifier: Apache-2.0
"""Upstream's module path of the ``zero_optimization.zenflow`` section: ``ZenFlowConfig``
(defined in :mod:`deepspeed.runtime.zenflow.config`)."""

from deepspeed.runtime.zenflow.config import ZenFlowConfig  # noqa: F401
