# SPDX-License-Identifier: Apache-2.0
"""The pieces :class:`~deepspeed.runtime.engine.DeepSpeedEngine` composes: its public surface (``api``, the generated
``names``), lifecycle, device mesh, state moves, timers and reports, the accumulation window, usage errors, and the
optimizer it builds and returns.

The modules here may import each other, ``deepspeed.runtime.configuration``, the ZeRO stages and their helpers
(``deepspeed.runtime.zero``), upstream's ``deepspeed.runtime`` modules below the engine (``base_optimizer``,
``eigenvalue``, ...), ``deepspeed.ops``, ``comm``, ``monitor``, ``profiling`` and ``utils``; never
``deepspeed.runtime.engine`` (the engine imports them). This ``__init__`` imports nothing, so importing one part
does not import the others.
"""
