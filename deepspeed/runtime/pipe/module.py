# SPDX-License-Identifier: Apache-2.0
"""Pipeline-parallel model specifications: importable, not built yet.

Upstream's test helpers and user code import ``PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec``
(often only to test ``isinstance``), so the names exist with upstream's constructor signatures. Pipeline
parallelism itself is not part of this release: constructing any of them raises ``NotImplementedError``
(see docs/compatibility.md), rather than training something else than asked.
"""

from torch import nn

from deepspeed.runtime.activation_checkpointing import checkpointing

_NOT_YET = ("pipeline parallelism is not supported yet in this release (data parallelism with ZeRO stages "
            "0-3 is); see docs/compatibility.md")


class PipelineError(Exception):
    """Errors related to the use of ``deepspeed.pipe.PipelineModule``."""


class LayerSpec:
    """The specification of one pipeline layer: ``typename(*module_args, **module_kwargs)``, built later."""

    def __init__(self, typename, *module_args, **module_kwargs):
        raise NotImplementedError(f"deepspeed.pipe.LayerSpec: {_NOT_YET}")


class TiedLayerSpec(LayerSpec):
    """A :class:`LayerSpec` whose ``tied_weight_attr`` parameters are shared by every layer with ``key``."""

    def __init__(self, key, typename, *module_args, forward_fn=None, tied_weight_attr=["weight"], **module_kwargs):
        raise NotImplementedError(f"deepspeed.pipe.TiedLayerSpec: {_NOT_YET}")


class PipelineModule(nn.Module):
    """A model given as a sequence of layers, to be split into pipeline stages."""

    def __init__(self,
                 layers,
                 num_stages=None,
                 topology=None,
                 loss_fn=None,
                 seed_layers=False,
                 seed_fn=None,
                 base_seed=1234,
                 partition_method="parameters",
                 activation_checkpoint_interval=0,
                 activation_checkpoint_func=checkpointing.checkpoint,
                 checkpointable_layers=None,
                 dynamic_shape=False):
        raise NotImplementedError(f"deepspeed.pipe.PipelineModule: {_NOT_YET}")
