# SPDX-License-Identifier: Apache-2.0
"""Pipeline parallelism: the public names, importable; constructing them raises (see module.py)."""

from .module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec"]
