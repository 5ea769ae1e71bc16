# SPDX-License-Identifier: Apache-2.0
"""Checkpoint engines: how checkpoint files are created, written, read and committed (upstream's package).

``TorchCheckpointEngine`` (``torch.save`` / ``torch.load``) is built; the fast, decoupled and DataStates
writers are not (constructing them raises ``NotImplementedError``).
"""

from .checkpoint_engine import CheckpointCommitInfo, CheckpointEngine  # noqa: F401
from .torch_checkpoint_engine import TorchCheckpointEngine  # noqa: F401
from .not_built import DataStatesCheckpointEngine, DecoupledCheckpointEngine, FastCheckpointEngine  # noqa: F401
from .utils import create_checkpoint_engine  # noqa: F401
