# SPDX-License-Identifier: Apache-2.0
"""``create_checkpoint_engine``: the checkpoint engine a config asks for."""

from deepspeed.runtime.checkpoint_engine.not_built import DecoupledCheckpointEngine, FastCheckpointEngine
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine


def create_checkpoint_engine(config_params, groups, zero_stage, has_moe_layers, optimize_dp_state):
    """``TorchCheckpointEngine``, unless ``checkpoint.writer`` asks for the fast or decoupled writer (not built:
    ``NotImplementedError``)."""
    checkpoint_config = getattr(config_params, "checkpoint_config", None) if config_params is not None else None
    writer = checkpoint_config.get("writer") if checkpoint_config else None
    if writer is not None:
        decoupled = writer.get("decoupled", False) if isinstance(writer, dict) else getattr(writer, "decoupled", False)
        cls = DecoupledCheckpointEngine if decoupled else FastCheckpointEngine
        return cls(config_params, None, optimize_dp_state)
    return TorchCheckpointEngine(config_params)
