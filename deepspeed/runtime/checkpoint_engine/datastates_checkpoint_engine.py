# SPDX-License-Identifier: Apache-2.0
"""``DataStatesCheckpointEngine``: upstream's engine over the external DataStates library, not built here.

Constructing it raises ``NotImplementedError``; a config with ``datastates_ckpt`` is refused by ``initialize``
(docs/compatibility.md). ``checkpoint.writer`` with ``decoupled`` gives asynchronous checkpoints without it.
"""

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

ENGINE_NAME = "DataStatesCheckpointEngine"


class DataStatesCheckpointEngine(CheckpointEngine):

    def __init__(self, deepspeed_config=None, rank=None):
        raise NotImplementedError("DataStatesCheckpointEngine (the DataStates library's asynchronous checkpoints) is "
                                  "not built in this runtime; use checkpoint.writer with decoupled=true; see "
                                  "docs/compatibility.md")

    def create(self, info):  # pragma: no cover - never constructed
        raise NotImplementedError

    def save(self, state_dict, path):  # pragma: no cover
        raise NotImplementedError

    def load(self, path, map_location=None):  # pragma: no cover
        raise NotImplementedError

    def commit(self, info):  # pragma: no cover
        raise NotImplementedError
