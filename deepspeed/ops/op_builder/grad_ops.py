# SPDX-License-Identifier: Apache-2.0
"""``GradOpsBuilder``: the CUDA kernels of the gradient pipeline's arithmetic (``csrc/grad_ops``)."""

from .builder import CUDAOpBuilder


class GradOpsBuilder(CUDAOpBuilder):
    """Multi-tensor scale-and-accumulate, copy-in, squared norm with fused unscale, and cast-copy: the native
    implementations of ``deepspeed.runtime.zero.gradients.grad_ops`` (``deepspeed.ops.grad_ops_native`` registers
    them)."""

    NAME = "grad_ops"
    BUILD_VAR = "DS_BUILD_GRAD_OPS"

    def __init__(self, name=None):
        super().__init__(name=name)

    def absolute_name(self):
        return f"deepspeed.ops.{self.NAME}_op"

    def sources(self):
        return ["csrc/grad_ops/grad_ops.cpp", "csrc/grad_ops/grad_ops_kernels.cu"]

    def include_paths(self):
        return ["csrc/grad_ops"]
