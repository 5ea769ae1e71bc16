# SPDX-License-Identifier: Apache-2.0
"""The classes of the optimizer ``deepspeed.initialize`` returns, under upstream's names.

Frameworks and user code recognise DeepSpeed's optimizer with ``isinstance`` against upstream's wrapper
classes. Here one class does the work for every stage and precision (:class:`EngineOptimizer`: the boundary
step over the stage's gradients); these subclasses only give it the name upstream would use for the same
configuration, chosen by :func:`returned_optimizer_class`:

================================================  ==========================================
configuration                                      class (``deepspeed.runtime...``)
================================================  ==========================================
ZeRO stage 1 or 2                                  ``zero.stage_1_and_2.DeepSpeedZeroOptimizer``
ZeRO stage 1, bf16 model, ``data_types.grad_accum_dtype: fp32``, no offload
                                                   ``bf16_optimizer.BF16_Optimizer``
ZeRO stage 3                                       ``zero.stage3.DeepSpeedZeroOptimizer_Stage3``
stage 0, fp16 or bf16, a ``FusedAdam``             ``fp16.fused_optimizer.FP16_Optimizer``
stage 0, fp16 or bf16, another optimizer           ``fp16.unfused_optimizer.FP16_UnfusedOptimizer``
stage 0, fp32                                      ``EngineOptimizer`` (upstream returns the bare torch optimizer)
================================================  ==========================================

They add no behaviour and no state; the ZeRO classes give upstream's name for a view of the rank's fp32 master
partitions (one flat tensor per parameter group, the tensors the inner optimizer steps and a checkpoint saves).
Upstream constructs them itself inside ``initialize``, with internal arguments (the inner optimizer, timers, the
loss-scaler config, ...); constructing one directly is not built here and raises ``NotImplementedError``:
``deepspeed.initialize`` is the way to get one.
"""

import torch

from deepspeed.runtime.engine_parts.optimizer import EngineOptimizer


class _ReturnedOptimizer(EngineOptimizer):
    """Base of the named facades (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is built by deepspeed.initialize (the optimizer it returns "
                                  f"is an instance); constructing it directly is not supported in this runtime; see "
                                  f"docs/compatibility.md")

    @classmethod
    def for_engine(cls, *args, **kwargs):
        """Build the engine's optimizer as this class (``EngineOptimizer``'s arguments)."""
        optimizer = cls.__new__(cls)
        EngineOptimizer.__init__(optimizer, *args, **kwargs)
        return optimizer


def _fp32_partitions(optimizer):
    """This rank's fp32 master partitions, one flat tensor per parameter group, after any step still updating them."""
    optimizer.stage._masters_current()
    return list(optimizer.stage.masters)


class DeepSpeedZeroOptimizer(_ReturnedOptimizer):
    """The optimizer of ZeRO stages 1 and 2."""

    @property
    def single_partition_of_fp32_groups(self):
        """Upstream's name: this rank's fp32 master partition of each parameter group (live tensors)."""
        return _fp32_partitions(self)


class DeepSpeedZeroOptimizer_Stage3(_ReturnedOptimizer):
    """The optimizer of ZeRO stage 3.

    It also answers for upstream's hook manager the way TRL's ``unwrap_model_for_generation`` drives it: ``module``,
    ``forward_hooks`` (the module hooks that gather and release the units: removing them and assigning ``[]``
    leaves the model's forward unhooked), ``backward_hooks`` (none are kept here: per-backward hooks live on the
    forward's outputs) and ``_register_deepspeed_module(module)`` / ``_register_hooks_recursively(module)``, which
    install the module hooks again."""

    @property
    def fp32_partitioned_groups_flat(self):
        """Upstream's name: this rank's fp32 master partition of each parameter group (live tensors)."""
        return _fp32_partitions(self)

    @property
    def module(self):
        return self.stage.module

    @property
    def forward_hooks(self):
        return self.stage.coordinator.hook_handles

    @forward_hooks.setter
    def forward_hooks(self, handles):
        self.stage.coordinator.hook_handles = handles

    @property
    def backward_hooks(self):
        return self.__dict__.get("_backward_hooks", [])

    @backward_hooks.setter
    def backward_hooks(self, handles):
        self.__dict__["_backward_hooks"] = list(handles)

    def _register_deepspeed_module(self, module, count=None):
        """Install the module hooks again (after their handles were removed); ``module`` is the engine's."""
        if module is not self.stage.module:
            raise ValueError("_register_deepspeed_module: the engine's hooks cover the engine's module only")
        self.stage.coordinator.reinstall_hooks()

    _register_hooks_recursively = _register_deepspeed_module


class BF16_Optimizer(_ReturnedOptimizer):
    """The optimizer of ZeRO stage 1 with a bf16 model and fp32 gradient accumulation."""


class FP16_Optimizer(_ReturnedOptimizer):
    """The optimizer of a 16-bit model without ZeRO, stepping a ``FusedAdam``."""


class FP16_UnfusedOptimizer(_ReturnedOptimizer):
    """The optimizer of a 16-bit model without ZeRO, stepping any other optimizer."""


def returned_optimizer_class(stage, model_dtype, grad_accum_dtype, inner, offload):
    """The class of the optimizer an engine with this configuration returns (table in the module docstring)."""
    from deepspeed.ops.adam import FusedAdam
    if stage == 3:
        return DeepSpeedZeroOptimizer_Stage3
    if stage in (1, 2):
        if stage == 1 and model_dtype == torch.bfloat16 and grad_accum_dtype == torch.float32 and not offload:
            return BF16_Optimizer
        return DeepSpeedZeroOptimizer
    if model_dtype in (torch.float16, torch.bfloat16):
        return FP16_Optimizer if isinstance(inner, FusedAdam) else FP16_UnfusedOptimizer
    return EngineOptimizer


def build_returned_optimizer(cls, *args, **kwargs):
    """An instance of ``cls`` (one of the classes above, or ``EngineOptimizer``) for the engine."""
    if cls is EngineOptimizer:
        return EngineOptimizer(*args, **kwargs)
    return cls.for_engine(*args, **kwargs)
