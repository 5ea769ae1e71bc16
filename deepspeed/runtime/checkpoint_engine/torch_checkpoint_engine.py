# SPDX-License-Identifier: Apache-2.0
"""``TorchCheckpointEngine``: files written with ``torch.save`` and read with ``torch.load``.

``checkpoint.checkpoint_serialization`` of the config picks torch's zipfile format (the default when a
config is given); without a config the legacy format is written, as upstream does. Each file is written
atomically (a temporary name, ``fsync``, rename) through a Python file object of ours, so that a failed write
raises the operating system's error (``file_writers``).
"""

import torch

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
from deepspeed.utils.logging import log_dist

CHECKPOINT_SERIALIZATION = "checkpoint_serialization"
ENGINE_NAME = "TorchCheckpointEngine"


def zipfile_serialization(config_params):
    """``checkpoint.checkpoint_serialization`` of a ``DeepSpeedConfig`` (False without one, as upstream)."""
    checkpoint_config = getattr(config_params, "checkpoint_config", None) if config_params is not None else None
    return bool(checkpoint_config[CHECKPOINT_SERIALIZATION]) if checkpoint_config else False


class TorchCheckpointEngine(CheckpointEngine):
    """See the module docstring."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.zipfile_serialization = zipfile_serialization(config_params)

    def create(self, info: CheckpointCommitInfo):
        log_dist(f"[Torch] Checkpoint {info.tag} is about to be saved!", ranks=[0])

    def open_file(self, path):
        """The file object one checkpoint file is serialized through (``file_writers``)."""
        from deepspeed.runtime.checkpoint_engine.file_writers import PythonFileWriter
        return PythonFileWriter(path)

    def save(self, state_dict, path: str):
        self.write_file(state_dict, path)

    def write_file(self, state_dict, path: str):
        """Write ``state_dict`` to ``path`` now, atomically and synced (what a background writer runs, too)."""
        from deepspeed.runtime.checkpoint.writer import atomic_serialize
        atomic_serialize(state_dict, path, self.open_file, self.zipfile_serialization)

    def load(self, path: str, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo):
        return True
