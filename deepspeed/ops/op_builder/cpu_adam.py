# SPDX-License-Identifier: Apache-2.0
"""``CPUAdamBuilder``: the host Adam/AdamW step (``csrc/adam/cpu_adam.cpp``), used by ``DeepSpeedCPUAdam``."""

from .builder import TorchCPUOpBuilder


class CPUAdamBuilder(TorchCPUOpBuilder):
    """One multithreaded pass of Adam or AdamW over flat fp32 tensors, optionally writing the updated parameters'
    bf16 or fp16 copy into a given buffer in the same pass (``deepspeed.ops.adam.host_adam`` calls it)."""

    NAME = "cpu_adam"
    BUILD_VAR = "DS_BUILD_CPU_ADAM"

    def __init__(self, name=None):
        super().__init__(name=name)

    def absolute_name(self):
        return f"deepspeed.ops.adam.{self.NAME}_op"

    def sources(self):
        return ["csrc/adam/cpu_adam.cpp"]

    def cxx_args(self):
        # Every operation rounded on its own (no contraction into fused multiply-adds): an element's result is the
        # same whatever the compiler vectorizes, and a GPU running the same torch operations gets the same bits.
        return super().cxx_args() + ["-ffp-contract=off"]
