# SPDX-License-Identifier: Apache-2.0
"""``BlockQuantBuilder``: ZeRO++'s block quantization of rows on the host (``csrc/quantization/block_quant.cpp``)."""

from .builder import TorchCPUOpBuilder


class BlockQuantBuilder(TorchCPUOpBuilder):
    """Symmetric 4/8-bit block quantize and dequantize of rows in one threaded pass: the native version of
    ``deepspeed.runtime.zero.gradients.block_quant`` for host tensors (``deepspeed.ops.block_quant_native`` registers
    it)."""

    NAME = "block_quant"
    BUILD_VAR = "DS_BUILD_BLOCK_QUANT"

    def __init__(self, name=None):
        super().__init__(name=name)

    def absolute_name(self):
        return f"deepspeed.ops.{self.NAME}_op"

    def sources(self):
        return ["csrc/quantization/block_quant.cpp"]

    def cxx_args(self):
        # each operation rounded on its own, so the codes are the torch reference's bit for bit
        return super().cxx_args() + ["-ffp-contract=off"]
