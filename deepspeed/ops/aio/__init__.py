# SPDX-License-Identifier: Apache-2.0
"""Asynchronous NVMe I/O (upstream's ``deepspeed.ops.aio``): ``AsyncIOBuilder`` reports not compatible and its
``load()`` raises ``NotImplementedError`` (NVMe offload is not built; offload goes to CPU memory)."""

from ..op_builder import AsyncIOBuilder  # noqa: F401
