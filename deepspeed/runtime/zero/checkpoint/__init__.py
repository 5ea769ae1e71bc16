# SPDX-License-Identifier: Apache-2.0
"""Each ZeRO stage's checkpoint export and import (the interface of ``runtime/checkpoint/stage_checkpoint.py``):
``stage0``, ``partitioned`` (stages 1 and 2) and ``stage3``.

Not to be confused with ``deepspeed.runtime.checkpoint``, the engine's checkpoint writer and loader, which these
modules implement an interface of; import either by its absolute path.

May import: ``units`` (ZeRO++'s packed frozen weights), ``deepspeed.runtime.checkpoint`` and the upstream-path
module ``partition_parameters``. Never the stage classes (``stage0``, ``stage_1_and_2``, ``stage3``,
``stage_base``, ``stages``): they import this package. This ``__init__`` imports nothing, so importing one module
here brings in no sibling.
"""
