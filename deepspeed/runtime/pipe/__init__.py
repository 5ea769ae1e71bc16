# SPDX-License-Identifier: Apache-2.0
"""Pipeline parallelism: the model specification, the topology, the schedules and the engine that runs them."""

from .module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec
from .topology import ProcessTopology

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
