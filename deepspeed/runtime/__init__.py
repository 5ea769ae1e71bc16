# SPDX-License-Identifier: Apache-2.0
"""The training runtime: the engine (``engine.py``) and what it conducts.

Upstream's module paths stay at this level (``engine``, ``config``, ``config_utils``, ``constants``, ``utils``,
``lr_schedules``, ``dataloader``, ...); this package's own helpers live in subpackages by concern: ``engine_parts``
(what the engine composes), ``configuration`` (config helpers), ``backward`` (the backward session), ``zero`` (the
stages and the gradient pipeline), ``precision``, ``checkpoint``, ``audit``, and the parallelisms (``pipe``,
``tensor_parallel``, ``sequence_parallel``). docs/architecture.md has the map.
"""
