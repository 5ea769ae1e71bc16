# SPDX-License-Identifier: Apache-2.0
"""``TorchCheckpointEngine``: files written with ``torch.save`` and read with ``torch.load``.

``checkpoint.checkpoint_serialization`` of the config picks torch's zipfile format (the default when a
config is given); without a config the legacy format is written, as upstream does.
"""

import torch

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
from deepspeed.utils.logging import log_dist

CHECKPOINT_SERIALIZATION = "checkpoint_serialization"
ENGINE_NAME = "TorchCheckpointEngine"


class TorchCheckpointEngine(CheckpointEngine):
    """See the module docstring."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.name = ENGINE_NAME
        checkpoint_config = getattr(config_params, "checkpoint_config", None) if config_params is not None else None
        self.zipfile_serialization = bool(checkpoint_config[CHECKPOINT_SERIALIZATION]) if checkpoint_config else False

    def create(self, info: CheckpointCommitInfo):
        log_dist(f"[Torch] Checkpoint {info.tag} is about to be saved!", ranks=[0])

    def save(self, state_dict, path: str):
        torch.save(state_dict, path, _use_new_zipfile_serialization=self.zipfile_serialization)

    def load(self, path: str, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo):
        return True
