# SPDX-License-Identifier: Apache-2.0
"""Upstream's other checkpoint writers, not built in this runtime: the fast (double-buffered, parallel) writer,
the decoupled (background) writer and the DataStates engine. Constructing one raises ``NotImplementedError``;
``TorchCheckpointEngine`` writes every checkpoint here."""

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine


class _NotBuiltCheckpointEngine(CheckpointEngine):
    feature = ""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} ({self.feature}) is not built in this runtime; checkpoints "
                                  f"are written with TorchCheckpointEngine; see docs/compatibility.md")

    def create(self, info):  # pragma: no cover - never constructed
        raise NotImplementedError

    def save(self, state_dict, path):  # pragma: no cover
        raise NotImplementedError

    def load(self, path, map_location=None):  # pragma: no cover
        raise NotImplementedError

    def commit(self, info):  # pragma: no cover
        raise NotImplementedError


class FastCheckpointEngine(_NotBuiltCheckpointEngine):
    feature = "the fast checkpoint writer, checkpoint.writer"


class DecoupledCheckpointEngine(_NotBuiltCheckpointEngine):
    feature = "the decoupled checkpoint writer, checkpoint.writer.decoupled"


class DataStatesCheckpointEngine(_NotBuiltCheckpointEngine):
    feature = "the DataStates checkpoint engine"
