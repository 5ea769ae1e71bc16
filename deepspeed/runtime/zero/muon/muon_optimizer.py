# SPDX-License-Identifier: Apache-2.0
"""``MuonWithAuxAdam`` where upstream's code imports it from (:mod:`deepspeed.ops.muon`)."""

from deepspeed.ops.muon.muon import MuonWithAuxAdam

__all__ = ['MuonWithAuxAdam']
