# SPDX-License-Identifier: Apache-2.0
"""Automatic tensor parallelism for training (AutoTP), under upstream's module paths: not built.

The names import; ``TpTrainingManager``, ``tp_model_init`` and ``get_tensor_parallel_config`` for a config
with ``tensor_parallel.autotp_size > 1`` raise ``NotImplementedError``.
"""

from .config import AUTOTP_MODE, get_tensor_parallel_config  # noqa: F401
from .tp_manager import TpTrainingManager  # noqa: F401
