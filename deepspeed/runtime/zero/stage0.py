# SPDX-License-Identifier: Apache-2.0
"""ZeRO stage 0: replicated gradients, all-reduced in fixed-order buckets; fp32 masters for 16-bit models.

The window gradient is one flat buffer in the accumulation dtype (fp32 by default),
replicated on every rank (:class:`~deepspeed.runtime.zero.gradients.reduction.ReplicatedGeometry`).
Outside the boundary micro-step contributions only accumulate; the boundary backward
(unless ``no_sync``, ``coalesce_grad_reduction`` or unmanaged accumulation defers it)
all-reduces each bucket as it completes, in bucket order. The mean's 1/W is folded into
the contribution factor, so a reduction is a plain sum.

With fp32 parameters and fp32 accumulation the reduced gradient is also published as
``param.grad`` (views of the buffer), as DDP and upstream's stage 0 leave it; the
ownership pre-hook removes those views before autograd could accumulate into them.
With 16-bit parameters the optimizer steps fp32 masters whose ``.grad`` are views of the
buffer; the masters are copied back into the model after the step.
"""

import torch

import deepspeed.comm as dist

from deepspeed.runtime.precision.master_params import MasterParams
from deepspeed.runtime.zero.checkpoint.stage0 import Stage0Checkpoint
from deepspeed.runtime.zero.gradients import grad_ops
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as Kind
from deepspeed.runtime.zero.gradients.profiling import ds_range
from deepspeed.runtime.zero.gradients.reduction import ReplicatedGeometry
from deepspeed.runtime.zero.stage_base import ZeroStage, fp32_grads, trainable_groups
from deepspeed.utils.timer import OPTIMIZER_STEP_TIMER


class Stage0(ZeroStage):
    """Stage 0 (see the module docstring)."""

    stage = 0

    def __init__(self, module, optimizer, config, clock, *, device, group, reduction=None):
        super().__init__(config, optimizer, clock, device=device, group=group, reduction=reduction)
        params = [p for g in trainable_groups(optimizer) for p in g]
        order = {id(p): i for i, p in enumerate(module.parameters())}
        params.sort(key=lambda p: order.get(id(p), len(order)))  # module order: about the reverse of backward's
        low_precision = any(p.dtype != torch.float32 for p in params)
        fp32_window = config.accum_dtype == torch.float32
        self.publishes_grads = not low_precision and fp32_window
        geometry = ReplicatedGeometry(params, bucket_numel=config.bucket_numel, **self._geometry_args())
        # Stage 0 reduces in place: a reduction in flight holds no memory of its own, so none is bounded.
        self._build_pipeline(geometry,
                             reduce_in_every_backward=False,
                             in_flight_limit=None,
                             on_backward_end=self._after_backward)
        self._published = False
        self.masters = None
        if low_precision:
            self.masters = MasterParams(params, geometry.grad_view if fp32_window else None)
            self.masters.swap_into(optimizer.param_groups)

    def global_grad_norm(self):
        """As every stage's (stage_base); with expert parameters, or a tensor-parallel model, the window gradient is
        not the same on every rank: each part is replicated over its own group, so the squares are summed over the
        norm group with the weight 1 / (that group's size)."""
        group, size = self._norm_group()
        if self._norm is None and size > 1 and (self.reduction.is_mixed(self.params) or size != self.world_size):
            with ds_range("DS::grad_norm"):
                sq = torch.zeros((), dtype=torch.float32, device=self.device)
                for spec, regions in self.geometry.regions_by_spec():
                    sq = sq + grad_ops.partial_sq_norm(regions, device=self.device) / (spec.world_size * spec.copies)
                dist.all_reduce(sq, group=group)
                self._norm = sq.sqrt()
        return super().global_grad_norm()

    def _after_backward(self, reduced):
        if reduced and self.publishes_grads:
            self.publish_grads()

    # ------------------------------------------------------------------ step
    def optimizer_step(self):
        with ds_range("DS::step"), self.timed(OPTIMIZER_STEP_TIMER):
            if self.masters is not None:
                if self.config.accum_dtype != torch.float32:
                    self._attach_fp32_grads(lambda p: self.masters.master_of(p))
                self.optimizer.step()
                self.masters.drop_step_grads()
                self.masters.copy_to_model()
            elif self.publishes_grads:
                self.publish_grads()
                self.optimizer.step()
            else:  # fp32 parameters, lower-precision window: fp32 gradients for this step only
                self._attach_fp32_grads(lambda p: p)
                self.optimizer.step()
                for p in self.params:
                    p.grad = None

    def _attach_fp32_grads(self, target_of):
        flat, = fp32_grads(self.geometry.partitions())
        layout = self.geometry.layout
        for p in self.params:
            target_of(p).grad = layout.view(flat, p)

    def zero_window(self):
        self.unpublish_grads()
        super().zero_window()

    def publish_grads(self):
        """Expose the reduced gradient as ``param.grad`` (views of the window buffer; fp32 parameters only)."""
        for param in self.params:
            param.grad = self.geometry.grad_view(param)
        self._published = True

    def unpublish_grads(self):
        if self._published:
            self._published = False
            for param in self.params:
                param.grad = None

    def release(self):
        self.unpublish_grads()
        super().release()

    def checkpoint(self):
        return Stage0Checkpoint(self)

    def state_table(self):
        table = super().state_table()
        if self._published:  # the reduced gradient as ``param.grad``: views of the window buffer
            table[Kind.lp_grads] = table[Kind.lp_grads] + [p.grad for p in self.params if p.grad is not None]
        return table

    def _master_tensors(self):
        """The fp32 masters; fp32 parameters are their own masters (one storage serves both kinds)."""
        return list(self.masters.masters) if self.masters is not None else list(self.params)

    # ------------------------------------------------------------- accessors
    def full_grad(self, param):
        return self.geometry.grad_view(param)

    def set_full_grad(self, param, value):
        self.geometry.grad_view(param).copy_(value)

    def fp32_param(self, param):
        master = self.masters.master_of(param) if self.masters is not None else None
        return master if master is not None else param

    def set_fp32_param(self, param, value):
        with torch.no_grad():
            master = self.fp32_param(param)
            master.copy_(value)
            if master is not param:
                param.copy_(master)

    def optimizer_state(self, param, key):
        return self.optimizer.state.get(self.fp32_param(param), {}).get(key)

    def set_optimizer_state(self, param, key, value):
        state = self.optimizer_state(param, key)
        if state is None:
            raise KeyError(f"optimizer state '{key}' does not exist for this parameter yet")
        with torch.no_grad():
            state.copy_(value)
