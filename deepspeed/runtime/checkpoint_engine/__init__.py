# SPDX-License-Identifier: Apache-2.0
"""Checkpoint engines: how checkpoint files are created, written, read and committed (upstream's package).

``TorchCheckpointEngine`` (``torch.save`` / ``torch.load``, the default), ``FastCheckpointEngine``
(``checkpoint.writer``: the ``fast`` writer on the ``async_io`` op, or ``python``) and ``DecoupledCheckpointEngine``
(``checkpoint.writer.decoupled``: written and committed behind training). ``DataStatesCheckpointEngine`` is not
built (constructing it raises ``NotImplementedError``). docs/checkpoints.md describes them.
"""

from .checkpoint_engine import CheckpointCommitInfo, CheckpointEngine  # noqa: F401
from .torch_checkpoint_engine import TorchCheckpointEngine  # noqa: F401
from .fast_checkpoint_engine import FastCheckpointEngine  # noqa: F401
from .decoupled_checkpoint_engine import DecoupledCheckpointEngine  # noqa: F401
from .datastates_checkpoint_engine import DataStatesCheckpointEngine  # noqa: F401
from .utils import create_checkpoint_engine  # noqa: F401
