# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3 parameter units and their fetching: unit lifetimes, the per-phase fetch (group, transport, ZeRO++ wire
format), quantized frozen weights, ZeRO++'s key checks and ``unwrap_model_for_generation``.

May import: ``gradients`` (its ``transport``, ``block_quant`` and ``profiling``) and the upstream-path modules
``partition_parameters`` and ``parameter_offload``. Never the stage classes (``stage0``, ``stage_1_and_2``,
``stage3``, ``stage_base``, ``stages``): they import this package. This ``__init__`` imports nothing, so importing
one module here brings in no sibling.
"""
