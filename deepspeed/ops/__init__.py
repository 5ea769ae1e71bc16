# SPDX-License-Identifier: Apache-2.0
"""Optimizers and native ops.

``adam`` (FusedAdam on torch's kernels, DeepSpeedCPUAdam on the host Adam op or torch's kernels), ``lion``
(FusedLion, DeepSpeedCPULion), ``adagrad`` (DeepSpeedCPUAdagrad), ``lamb``, the
op builders (``op_builder``) and ``__compatible_ops__``: op name -> whether the op can be built on this machine
(upstream's name; computed on first access).
"""

from deepspeed.ops import adagrad, adam, lamb, lion  # noqa: F401


def __getattr__(name):
    if name == "__compatible_ops__":
        from deepspeed.git_version_info import compatible_ops
        return compatible_ops
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
