# SPDX-License-Identifier: Apache-2.0
"""The ``zero_optimization.leaf_module`` section under upstream's module path.

``DeepSpeedZeroLeafModuleConfig`` (``classes``, ``names``, ``name_suffixes``) is defined with the rest of the
ZeRO section in :mod:`deepspeed.runtime.zero.config`; see docs/architecture.md for what a leaf module is.
"""

from deepspeed.runtime.zero.config import DEFAULT_LEAF_MODULE_CLASSES as _DEFAULT_CLASSES
from deepspeed.runtime.zero.config import DeepSpeedZeroLeafModuleConfig  # noqa: F401

DEFAULT_LEAF_MODULE_CLASSES = list(_DEFAULT_CLASSES)
DEFAULT_LEAF_MODULE_NAMES = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES = []

__all__ = [
    "DeepSpeedZeroLeafModuleConfig", "DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES"
]
