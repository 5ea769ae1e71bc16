# SPDX-License-Identifier: Apache-2.0
"""Asynchronous file I/O (upstream's ``deepspeed.ops.aio``): ``AsyncIOBuilder().load().aio_handle(...)``.

``async_io`` is the module ``AsyncIOBuilder().load()`` returns (``aio_handle``, ``aio_read``, ``aio_write``,
``deepspeed_memcpy``); ``backends`` holds its two engines (the compiled op ``csrc/aio/ds_aio.cpp``, and Python
threads where nothing can be compiled); ``buffers`` the aligned, page-locked host buffers. docs/ops.md describes them.
"""

from ..op_builder import AsyncIOBuilder  # noqa: F401
from .backends import ALIGNMENT, AsyncIOError  # noqa: F401
