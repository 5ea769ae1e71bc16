# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.pipe``: upstream's import path for the pipeline model specifications."""

from deepspeed.runtime.pipe import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec"]
