# SPDX-License-Identifier: Apache-2.0
"""Flat partitions: the rank-divisible layout of ZeRO stages 1 and 2, the master partitions and the optimizer
pointed at them (stages 1-3), and the matrix step over flat partitions.

May import: ``gradients`` (its ``profiling``) and ``offload`` (its ``transfers``). Never the stage classes
(``stage0``, ``stage_1_and_2``, ``stage3``, ``stage_base``, ``stages``): they import this package. This
``__init__`` imports nothing, so importing one module here brings in no sibling.
"""
