# SPDX-License-Identifier: Apache-2.0
"""The host step and the offload pipeline: host threads and maths, device <-> host transfers, the offloaded
optimizer step piece by piece (plain, speculative, unit by unit for ZeRO-3), partial offload, ZeRO-3 parameter
fetches from the host and the placement of an engine's state tensors.

May import: ``gradients`` (its ``grad_ops``, ``profiling`` and ``grad_pipeline`` phases) and the upstream-path
modules of ``deepspeed.runtime.zero`` that import none of the stage classes. Never the stage classes (``stage0``,
``stage_1_and_2``, ``stage3``, ``stage_base``, ``stages``): they import this package. This ``__init__`` imports
nothing, so importing one module here brings in no sibling.
"""
