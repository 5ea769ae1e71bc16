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


class FusedLionBuilder(TorchImplementedOpBuilder):
    """``fused_lion``: ``multi_tensor_lion`` on torch's foreach kernels (``deepspeed.ops.lion.fused_lion_op``)."""
    NAME = "fused_lion"
    BUILD_VAR = "DS_BUILD_FUSED_LION"
    MODULE = "deepspeed.ops.lion.fused_lion_op"


class CPULionBuilder(TorchImplementedOpBuilder):
    """``cpu_lion``: ``create_lion`` / ``lion_update`` / ``destroy_lion`` (``deepspeed.ops.lion.cpu_lion_op``)."""
    NAME = "cpu_lion"
    BUILD_VAR = "DS_BUILD_CPU_LION"
    MODULE = "deepspeed.ops.lion.cpu_lion_op"


class CPUAdagradBuilder(TorchImplementedOpBuilder):
    """``cpu_adagrad``: ``create_adagrad`` / ``adagrad_update`` / ``destroy_adagrad``
    (``deepspeed.ops.adagrad.cpu_adagrad_op``)."""
    NAME = "cpu_adagrad"
    BUILD_VAR = "DS_BUILD_CPU_ADAGRAD"
    MODULE = "deepspeed.ops.adagrad.cpu_adagrad_op"


TORCH_BUILDERS = [FusedAdamBuilder, FusedLionBuilder, CPULionBuilder, CPUAdagradBuilder]
