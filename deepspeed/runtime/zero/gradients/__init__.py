# SPDX-License-Identifier: Apache-2.0
"""The gradient pipeline: flat gradient buffers and their arithmetic (``grad_ops``), the reduction geometries and
specs, the transports that carry them (plain, quantized), block quantization and the profiler ranges.

May import: ``offload`` (a geometry folds into host partitions with its ``host_fold`` and ``transfers``) and the
upstream-path modules of ``deepspeed.runtime.zero`` that import none of the stage classes. Never the stage classes
(``stage0``, ``stage_1_and_2``, ``stage3``, ``stage_base``, ``stages``): they import this package. This ``__init__``
imports nothing, so importing one module here brings in no sibling.
"""
