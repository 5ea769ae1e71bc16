# SPDX-License-Identifier: Apache-2.0
"""This project's config helpers beside upstream's ``config.py`` / ``config_utils.py`` / ``constants.py``: the
``get_*`` readers ``config.py`` re-exports, the pydantic base model, the ``compile`` section, the audit of keys not
acted on, checkpoint-tag validation and the check that every rank was given the same config.

The modules here may import upstream's ``deepspeed.runtime.config_utils`` and ``constants``, ``deepspeed.utils``,
``deepspeed.comm`` and leaf helpers (``swap_tensor.swap_folder``, ``precision.module_cast``, the latter inside a
function); never the engine, its parts (``deepspeed.runtime.engine_parts``) or the ZeRO stages, since
``deepspeed.runtime.config`` imports them. This ``__init__`` imports nothing.
"""
