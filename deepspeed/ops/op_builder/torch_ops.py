# SPDX-License-Identifier: Apache-2.0
"""Builders of upstream ops that this package implements in torch: always compatible, nothing to compile.

``load()`` returns a module with the op's functions under upstream's names, so code that loads the op and calls
it directly works on any machine (CPU included). Only the standard library is imported here; the module is
imported on ``load()``.
"""

import importlib

from .builder import OpBuilder


class TorchImplementedOpBuilder(OpBuilder):
    """An op whose implementation is a torch module (``MODULE``): compatible everywhere, installed with the
    package, loaded by importing the module."""

    MODULE = ""

    def absolute_name(self):
        return self.MODULE

    def is_installed(self):
        return True

    def jit_buildable(self):
        return False

    def load(self, verbose=True):
        return importlib.import_module(self.MODULE)

    def jit_load(self, verbose=True):
        return self.load(verbose)


class FusedAdamBuilder(TorchImplementedOpBuilder):
    """``fused_adam``: ``multi_tensor_adam`` on torch's foreach kernels (``deepspeed.ops.adam.fused_adam_op``)."""
    NAME = "fused_adam"
    BUILD_VAR = "DS_BUILD_FUSED_ADAM"
    MODULE = "deepspeed.ops.adam.fused_adam_op"


TORCH_BUILDERS = [FusedAdamBuilder]
