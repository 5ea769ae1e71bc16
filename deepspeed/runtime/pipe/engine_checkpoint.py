# SPDX-License-Identifier: Apache-2.0
"""Checkpoint hooks of ``PipelineEngine``: ``save_checkpoint``/``load_checkpoint`` in upstream's pipeline layout,
delegated to ``deepspeed/runtime/pipe/checkpoint.py``.
"""


class CheckpointMixin:
    """``PipelineEngine``'s checkpoint entry points (they override ``DeepSpeedEngine``'s)."""

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """Collective: upstream's pipeline layout (per-layer files, per-stage model states, ZeRO files per stage and
        data-parallel rank); see ``deepspeed/runtime/pipe/checkpoint.py``."""
        from deepspeed.runtime.pipe import checkpoint
        self._states.require("save_checkpoint")  # EngineUsageError while offload_states() holds state
        return checkpoint.save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self,
                        load_dir,
                        tag=None,
                        load_module_strict=True,
                        load_optimizer_states=True,
                        load_lr_scheduler_states=True,
                        load_module_only=False,
                        custom_load_fn=None):
        """Collective: load a pipeline checkpoint (this runtime's or upstream's) into any cut and data-parallel
        size; returns ``(path, client_state)`` or ``(None, None)``."""
        from deepspeed.runtime.pipe import checkpoint
        self._states.require("load_checkpoint")
        return checkpoint.load(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only, custom_load_fn)
