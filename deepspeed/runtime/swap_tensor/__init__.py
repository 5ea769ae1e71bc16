# SPDX-License-Identifier: Apache-2.0
"""Tensor swapping to NVMe (ZeRO-Infinity), under upstream's module paths: not built.

The ``aio`` section is parsed (``aio_config.get_aio_config``) and the constants exist; every swapper class
raises ``NotImplementedError`` when constructed: offload goes to CPU memory in this runtime.
"""

from .utils import MIN_SWAPPABLE_BYTES  # noqa: F401
