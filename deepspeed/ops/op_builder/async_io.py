# SPDX-License-Identifier: Apache-2.0
"""``AsyncIOBuilder``: asynchronous file I/O for the disk tier of offload (``csrc/aio/ds_aio.cpp``).

The compiled op (``deepspeed.ops.aio.async_io_op``) is a pool of I/O threads working on raw addresses; it needs
only a C++ compiler and the C library. It is a plain shared library with a C interface, not a Python extension:
``deepspeed.ops.aio.backends`` loads it with ctypes (which releases the GIL during every call), and it compiles in
about two seconds (no torch or pybind11 headers). :meth:`AsyncIOBuilder.load` returns the module upstream's callers
expect, ``deepspeed.ops.aio.async_io`` (``aio_handle``, ``aio_read``, ``aio_write``, ``deepspeed_memcpy``), which
runs on the compiled op when it loads and on a pool of Python threads otherwise (same contract, docs/ops.md).
"""

import ctypes
import importlib
import importlib.util

from .builder import OpBuilder, cxx_compiler


class AsyncIOBuilder(OpBuilder):
    """The ``async_io`` op: reads and writes of host memory to files, many in flight, completed by ``wait()``."""

    NAME = "async_io"
    BUILD_VAR = "DS_BUILD_AIO"
    FRONT = "deepspeed.ops.aio.async_io"
    PYTHON_MODULE = False  # a plain shared library: jit_load returns its path, for ctypes

    def __init__(self, name=None):
        super().__init__(name=name)

    def absolute_name(self):
        return "deepspeed.ops.aio.async_io_op"

    def sources(self):
        return ["csrc/aio/ds_aio.cpp"]

    def cxx_args(self):
        return ["-O2", "-g0", "-pthread"]

    def extra_ldflags(self):
        return ["-pthread"]

    def incompatible_reason(self):
        if cxx_compiler() is None:
            return "no C++ compiler found; the aio handle runs on Python threads instead"
        return None

    def load_native(self, verbose=True):
        """The compiled library as a ``ctypes.CDLL`` (prebuilt, else built just in time; cached per process).

        Raises RuntimeError where it cannot be built."""
        if self.name in OpBuilder._loaded_ops:
            return OpBuilder._loaded_ops[self.name]
        path = None
        if self.is_installed():
            path = importlib.util.find_spec(self.absolute_name()).origin
        library = None
        if path is not None:
            try:
                library = ctypes.CDLL(path)
            except OSError as error:
                if verbose:
                    print(f"the prebuilt {self.name} op does not load ({error}); building it just in time")
        if library is None:
            library = ctypes.CDLL(self.jit_load(verbose))
        OpBuilder._loaded_ops[self.name] = library
        return library

    def load(self, verbose=True):
        """Upstream's ``async_io`` module: ``aio_handle`` and the module functions (compiled op or Python threads)."""
        return importlib.import_module(self.FRONT)
