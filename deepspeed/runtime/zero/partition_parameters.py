# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3 parameter partitioning API (``deepspeed.zero.Init``, ``GatheredParameters``).

Stage 3 is not available in this release. What already holds, because frameworks
call these for every stage: ``Init(enabled=False)`` is a no-op, and
``GatheredParameters`` over parameters that are not partitioned (plain tensors, or
any parameter of a stage 0-2 model) does nothing, with ``modifier_rank`` edits
broadcast from that rank so every rank keeps the same values.
"""

import contextlib

import torch


class ZeroParamStatus:
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def _is_partitioned(param):
    return hasattr(param, "ds_id")


class Init(contextlib.ContextDecorator):
    """Build a model with parameters partitioned at construction (stage 3 only)."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights=False, zero_quantized_nontrainable_weights=False,
                 sequence_data_parallel_group=None, param_swapper=None):
        self.enabled = enabled
        if enabled:
            raise NotImplementedError("deepspeed.zero.Init (ZeRO stage 3 parameter partitioning) is not available "
                                      "yet in this release; see docs/compatibility.md. Use enabled=False, or a "
                                      "stage 0-2 config.")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class GatheredParameters(contextlib.ContextDecorator):
    """Make partitioned parameters whole inside the context; a no-op for unpartitioned ones."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if isinstance(p, torch.Tensor)]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        if enabled and any(_is_partitioned(p) for p in self.params):
            raise NotImplementedError("GatheredParameters over ZeRO-3 partitioned parameters needs stage 3, which "
                                      "is not available yet; see docs/compatibility.md")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self.enabled or self.modifier_rank is None or exc[0] is not None:
            return False
        import deepspeed.comm as dist
        if dist.is_initialized() and dist.get_world_size() > 1:
            with torch.no_grad():
                for param in self.params:
                    dist.broadcast(param.data, src=self.modifier_rank)
        return False
