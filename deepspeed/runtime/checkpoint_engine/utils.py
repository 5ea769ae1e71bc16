# SPDX-License-Identifier: Apache-2.0
"""``create_checkpoint_engine``: the checkpoint engine a config asks for."""

from deepspeed.runtime.checkpoint_engine.decoupled_checkpoint_engine import DecoupledCheckpointEngine
from deepspeed.runtime.checkpoint_engine.fast_checkpoint_engine import FastCheckpointEngine, writer_config
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine


def create_checkpoint_engine(config_params, groups, zero_stage, has_moe_layers, optimize_dp_state):
    """``TorchCheckpointEngine``; with ``checkpoint.writer``, ``DecoupledCheckpointEngine`` when ``decoupled``, else
    ``FastCheckpointEngine`` (upstream's choice; ``datastates_ckpt`` is refused when the config is read)."""
    writer = writer_config(config_params)
    if writer is None:
        return TorchCheckpointEngine(config_params)
    cls = DecoupledCheckpointEngine if writer["decoupled"] else FastCheckpointEngine
    return cls(config_params, None, optimize_dp_state)
