# SPDX-License-Identifier: Apache-2.0
"""Offloading checkpointed hidden states to host memory (upstream's ``CheckpointHiddenStatesOffload``): not
built. The names import; constructing the context manager, or asking for it, raises ``NotImplementedError``.
Activation checkpointing itself (``deepspeed.checkpointing``) is built."""

from dataclasses import dataclass

from deepspeed.runtime.not_built import not_built_class, not_built_function

_FEATURE = "offloading checkpointed hidden states to host memory"


@dataclass
class CheckpointActivationOffloadStats:
    """Upstream's counters of the offload engine (kept for code that builds one)."""
    saved_tensors_seen: int = 0
    marked_tensors: int = 0
    offloaded_tensors: int = 0
    restored_tensors: int = 0
    skipped_marked_tensors: int = 0
    kept_last_tensors: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0


CheckpointHiddenStatesOffload = not_built_class("CheckpointHiddenStatesOffload", _FEATURE, module=__name__)
get_checkpoint_hidden_states_offloading_ctx_manager = not_built_function(
    "get_checkpoint_hidden_states_offloading_ctx_manager", _FEATURE, module=__name__)
patch_gradient_checkpointing_layer_marker = not_built_function("patch_gradient_checkpointing_layer_marker",
                                                               _FEATURE,
                                                               module=__name__)
