# SPDX-License-Identifier: Apache-2.0
"""Muon: ``MuonWithAuxAdam`` (the config optimizer), the partitioned ``torch.optim.Muon``, Newton-Schulz."""

from deepspeed.ops.muon.muon import MatrixOptimizer, MuonWithAuxAdam, PartitionedTorchMuon
from deepspeed.ops.muon.newton_schulz import muon_direction, orthogonalize
from deepspeed.ops.muon.param_split import muon_param_groups, tag_muon_params

__all__ = [
    'MatrixOptimizer', 'MuonWithAuxAdam', 'PartitionedTorchMuon', 'muon_direction', 'orthogonalize',
    'muon_param_groups', 'tag_muon_params'
]
