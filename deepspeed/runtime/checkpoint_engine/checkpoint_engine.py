# SPDX-License-Identifier: Apache-2.0
"""The checkpoint-engine interface: ``create(info)`` before a checkpoint's files are written, ``save(state, path)``
and ``load(path, map_location)`` per file, ``commit(info)`` once every file of the tag is written (a writer
that works in the background finishes there). ``is_data_parallel_writer(dp_rank)`` says which data-parallel
rank writes the replicated files (rank 0 by default)."""

import abc
import os
from dataclasses import dataclass


@dataclass
class CheckpointCommitInfo:
    """Which checkpoint a commit finishes: its tag, directory and whether ``latest`` is updated."""
    tag: str
    save_dir: str
    save_latest: bool


class CheckpointEngine(abc.ABC):
    """See the module docstring; ``config_params`` is the engine's ``DeepSpeedConfig`` (or None)."""

    def __init__(self, config_params=None):
        self.name = None

    @abc.abstractmethod
    def create(self, info: CheckpointCommitInfo):
        ...

    @abc.abstractmethod
    def save(self, state_dict, path: str):
        ...

    def makedirs(self, path, exist_ok=False):
        os.makedirs(path, exist_ok=exist_ok)

    @abc.abstractmethod
    def load(self, path: str, map_location=None):
        ...

    @abc.abstractmethod
    def commit(self, info: CheckpointCommitInfo):
        ...

    def is_data_parallel_writer(self, dp_rank):
        return dp_rank == 0

    def is_decoupled(self):
        """Whether writes finish after ``save`` returns (then only ``commit`` guarantees the files exist)."""
        return False

    def set_commit_info(self, info: CheckpointCommitInfo):
        pass

    def get_commit_info(self):
        return None

    def cleanup(self):
        pass

    def preserves_storage_sharing(self):
        """Whether tensors sharing storage are saved once (as ``torch.save`` does)."""
        return True
