# SPDX-License-Identifier: Apache-2.0
"""ZeRO stages 1 and 2: partitioned fp32 masters and optimizer state; stage 2 partitions gradients too.

Both stages use the flat, rank-divisible layout of :mod:`partition_layout`: rank ``r``
owns chunk ``r`` of every bucket, and its gradient partition, fp32 master partition and
optimizer state are the concatenation of its chunks (per param group). The gradient
pipeline (:class:`~deepspeed.runtime.zero.gradients.reduction.PartitionGeometry`) stages each
contribution, with its factor, into a full-size bucket and reduce-scatters complete
buckets into the rank's gradient partitions:

* stage 1 keeps one persistent full-size staging buffer and reduces in the boundary
  backward (or at ``step()``);
* stage 2 stages per bucket on demand and reduces in *every* backward, dropping each
  bucket's staging at launch: between backward calls no full gradient is kept.

On a world of one the partition is the whole gradient and contributions go straight
into it (no staging, no collective).

The step side: the model's trainable parameters become views of one flat 16-bit (or
fp32) buffer; the inner optimizer steps the fp32 master partitions (on the CPU with
``offload_optimizer``), and the updated partitions are all-gathered back into the model,
bucket by bucket.
"""

import torch

import deepspeed.comm as dist
from deepspeed.runtime.zenflow.config import window_on_device
from deepspeed.runtime.zenflow.stage_io import PartitionedIO
from deepspeed.runtime.zenflow.zenflow_step import ZenFlowStep
from deepspeed.runtime.zero.gradients import grad_ops
from deepspeed.runtime.zero.checkpoint.partitioned import PartitionedCheckpoint
from deepspeed.runtime.zero.partitions.matrix_step import install_matrix_step, stage12_blocks
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as Kind
from deepspeed.runtime.zero.offload.offload_step import HostStep
from deepspeed.runtime.zero.offload.piece_waits import PieceWaits
from deepspeed.runtime.zero.partitions.partition_layout import PartitionedLayout
from deepspeed.runtime.precision.low_precision_masters import check_optimizer
from deepspeed.runtime.zero.partitions.partitioned_step import (PartitionedOptimizerState, attach_step_grads,
                                                                master_partition, point_optimizer_at)
from deepspeed.runtime.zero.gradients.profiling import ds_range
from deepspeed.runtime.zero.gradients.reduction import PartitionGeometry
from deepspeed.runtime.zero.offload.speculative_step import NEEDS_PIPELINED_STEP, SpeculativeStep
from deepspeed.runtime.zero.stage_base import ZeroStage, global_rank, trainable_groups
from deepspeed.utils.timer import OPTIMIZER_ALLGATHER_TIMER, OPTIMIZER_STEP_TIMER


class PartitionedStage(PartitionedOptimizerState, ZeroStage):
    """Stages 1 and 2 (see the module docstring)."""

    def __init__(self, module, optimizer, config, clock, *, device, group, reduction=None):
        super().__init__(config, optimizer, clock, device=device, group=group, reduction=reduction)
        check_optimizer(config, optimizer)
        self.stage = config.stage
        groups = trainable_groups(optimizer)
        self.layout = layout = PartitionedLayout(groups, list(module.parameters()), config.bucket_numel,
                                                 self.world_size, self.rank, self.reduction.spec_of)
        self.has_experts = self.reduction.has_experts(layout.params)
        if self.reduction.tensor and (config.offload_optimizer or config.zenflow is not None):
            raise NotImplementedError("tensor parallelism (AutoTP) with offload_optimizer or ZenFlow is not "
                                      "supported; see docs/tensor_parallel.md")
        dtypes = {p.dtype for p in layout.params}
        if len(dtypes) > 1:
            raise ValueError(f"ZeRO stage {config.stage} needs one dtype for all trainable parameters, found {dtypes}")
        model_dtype = dtypes.pop() if dtypes else torch.float32
        self.part_device = torch.device(config.offload_optimizer) if config.offload_optimizer else self.device
        # ZenFlow (without zenflow.offload) keeps the gradient partitions on the device, where its window sums; the
        # masters and the optimizer stay on the host (runtime/zenflow/host_window.py)
        zenflow_on_device = config.zenflow is not None and window_on_device(config.zenflow)
        offload_grads = bool(config.offload_optimizer) and not zenflow_on_device

        # The model's trainable parameters become views of one flat buffer, so that the
        # all-gather after the step writes straight into them.
        self.flat_params = torch.zeros(layout.numel, dtype=model_dtype, device=device)
        with torch.no_grad():
            for p in layout.params:
                view = layout.full_view(self.flat_params, p)
                view.copy_(p.data)
                p.data = view

        geometry = PartitionGeometry(layout,
                                     persistent_staging=config.stage == 1,
                                     use_reduce_scatter=config.use_reduce_scatter,
                                     **self._geometry_args(self.part_device if offload_grads else None))
        self._build_pipeline(geometry,
                             reduce_in_every_backward=config.stage == 2,
                             in_flight_limit=self._in_flight_limit())
        self.masters = []
        for g, numel in enumerate(layout.group_part_numel):
            master = torch.zeros(numel, dtype=config.master_dtype, device=self.part_device)
            for bucket in layout.buckets:
                if bucket.group == g:
                    layout.bucket_part(master, bucket).copy_(layout.bucket_own_chunk_full(self.flat_params, bucket))
            self.masters.append(master_partition(master, geometry.grad_parts[g], config.pin_masters))
        point_optimizer_at(optimizer, self.masters, [bool(g) for g in groups])
        install_matrix_step(self, lambda muon_groups: stage12_blocks(layout, muon_groups), self.reduction.dense)
        self.host_step = None
        if config.offload_optimizer:
            self.host_step = HostStep(optimizer,
                                      self.masters,
                                      model_dtype,
                                      self.device,
                                      pin_memory=config.pin_memory,
                                      cores_perc=config.cpu_cores_perc,
                                      disk=config.optimizer_swap,
                                      page_table=self._page_table(),
                                      rank=global_rank())

        if config.super_offload and not (self.host_step is not None and self.host_step.pipeline is not None
                                         and config.accum_dtype == torch.float32):
            self.release()
            raise NotImplementedError(NEEDS_PIPELINED_STEP)
        self.zenflow = ZenFlowStep(self, config.zenflow, PartitionedIO(self, zenflow_on_device)) \
            if config.zenflow is not None else None
        self._forward_waits = PieceWaits(self, module) if self._pipelined() and self.world_size == 1 else None
        if self._pipelined():
            geometry.folder.barrier = self.host_step.finish  # the next backward writes what the step reads
            if config.super_offload:  # the step starts in the boundary backward (its own folder hooks)
                self.speculative = SpeculativeStep(self)

    def _page_table(self):
        """The disk tier's pages (``offload_optimizer.device: nvme``): each bucket's chunk, cut to page size."""
        config = self.config
        if config.optimizer_swap is None:
            return None
        from deepspeed.runtime.swap_tensor.paged_store import PageTable
        layout = self.layout
        pieces = [[(b.part_offset, b.chunk) for b in layout.buckets if b.group == g] for g in range(len(self.masters))]
        return PageTable(pieces, config.optimizer_swap.page_numel)

    def _pipelined(self):
        """Whether the offloaded step runs bucket by bucket with its uploads (see ``offload_step``)."""
        return (self.host_step is not None and self.host_step.pipeline is not None and self.zenflow is None
                and self.config.accum_dtype == torch.float32 and self.config.master_dtype == torch.float32)

    @property
    def grad_parts(self):
        return self.geometry.partitions()

    def _extra_sq_norm(self):
        """The chunks of a tensor-parallel model's replicated parameters are the same on every tensor-parallel rank:
        count them once."""
        pieces, copies = [], 1
        for bucket in self.layout.buckets:
            if bucket.spec is not None and bucket.spec.copies > 1 and bucket.params:
                pieces.append(self.layout.bucket_part(self.grad_parts[bucket.group], bucket))
                copies = bucket.spec.copies
        if not pieces:
            return 0.0
        return -(1.0 - 1.0 / copies) * grad_ops.partial_sq_norm(pieces, device=self.device)

    # ------------------------------------------------------------------ step
    def optimizer_step(self):
        if self.zenflow is not None:
            with ds_range("DS::step"), self.timed(OPTIMIZER_STEP_TIMER):
                self.zenflow.step()
            return
        if self._pipelined():
            with ds_range("DS::step"), self.timed(OPTIMIZER_STEP_TIMER):
                grad_scale = self._take_grad_scale()
                begun = self.speculative.verdict(grad_scale) if self.speculative is not None else None
                self.host_step.step_and_gather(self.layout,
                                               self.flat_params,
                                               self._bucket_group,
                                               grad_scale=grad_scale,
                                               background=self._forward_waits is not None,
                                               begun=begun)
            return
        with ds_range("DS::step"), self.timed(OPTIMIZER_STEP_TIMER):
            attached = attach_step_grads(self.masters, self.grad_parts)
            if self.host_step is not None:
                self.host_step.step()
            else:
                self.optimizer.step()
            for master in attached:
                master.grad = None
        with self.timed(OPTIMIZER_ALLGATHER_TIMER):
            self.all_gather_params()

    def _masters_current(self):
        super()._masters_current()
        if self.host_step is not None:
            self.host_step.sync_host()  # a step still running completes; masters on disk are read back
        if self.zenflow is not None:
            self.zenflow.sync_masters()

    def release(self):
        if self.speculative is not None:
            self.speculative.close()
        if getattr(self, "zenflow", None) is not None:
            self.zenflow.close()
        if self.host_step is not None:
            self.host_step.close()
        if getattr(self, "_forward_waits", None) is not None:
            self._forward_waits.remove()
        super().release()

    @torch.no_grad()
    def all_gather_params(self):
        """Put every rank's updated master partition into the model's parameters (a collective)."""
        if self.host_step is not None:
            self.host_step.finish()
            self.host_step.gather_into(self.layout, self.flat_params, self._bucket_group)
            return
        layout = self.layout
        works = []
        with ds_range("DS::param_all_gather"):
            for bucket in layout.buckets:
                send = layout.bucket_part(self.masters[bucket.group].data, bucket)
                send = send.to(device=self.device, dtype=self.flat_params.dtype, non_blocking=True)
                out = layout.bucket_full(self.flat_params, bucket)
                if bucket.world == 1:
                    out.copy_(send)
                else:
                    works.append(
                        dist.all_gather_into_tensor(out, send, group=self._bucket_group(bucket), async_op=True))
            for work in works:
                work.wait()

    def checkpoint(self):
        self._masters_current()
        return PartitionedCheckpoint(self)

    def state_table(self):
        table = super().state_table()
        table[Kind.lp_params] = [self.flat_params]  # the model's trainable parameters are views of it
        return table

    def _bucket_group(self, bucket):
        """The group ``bucket`` is partitioned over (its param group's reduction spec)."""
        return bucket.spec.group if bucket.spec is not None else self.group

    # ------------------------------------------------------------- accessors
    def _gather(self, part_buffer, param):
        """Collective: the full value of ``param`` from every rank's partition buffer (fp32)."""
        layout = self.layout
        slot = layout.slots[param]
        bucket = layout.buckets[slot.bucket]
        chunk = layout.bucket_part(part_buffer, bucket).to(self.device, torch.float32)
        if bucket.world == 1:
            full = chunk
        else:
            full = torch.empty(bucket.padded, dtype=torch.float32, device=self.device)
            dist.all_gather_into_tensor(full, chunk.contiguous(), group=self._bucket_group(bucket))
        return full.narrow(0, slot.offset - bucket.start, slot.numel).view(slot.shape)

    def _local(self, part_buffer, param):
        owned = self.layout.owned_ranges(param)
        if owned is None:
            return torch.empty(0, dtype=part_buffer.dtype, device=part_buffer.device)
        _, length, offset = owned
        return part_buffer.narrow(0, offset, length)

    def _write(self, part_buffer, param, value):
        owned = self.layout.owned_ranges(param)
        if owned is not None:
            start, length, offset = owned
            src = value.reshape(-1).narrow(0, start, length)
            part_buffer.narrow(0, offset, length).copy_(src)

    def _group(self, param):
        return self.layout.slots[param].group

    _gather_from = _gather

    def local_range(self, param):
        owned = self.layout.owned_ranges(param)
        return (0, 0) if owned is None else (owned[0], owned[1])

    def full_grad(self, param):
        return self._gather(self.grad_parts[self._group(param)], param)

    def set_full_grad(self, param, value):
        self._write(self.grad_parts[self._group(param)], param, value)

    def local_grad(self, param):
        return self._local(self.grad_parts[self._group(param)], param)

    def fp32_param(self, param):
        self._masters_current()
        return self._gather(self.masters[self._group(param)].data, param)

    def local_fp32_param(self, param):
        self._masters_current()
        return self._local(self.masters[self._group(param)].data, param)

    def set_fp32_param(self, param, value):
        self._masters_current()
        with torch.no_grad():
            self._write(self.masters[self._group(param)].data, param, value)
            param.copy_(value)
        if self.zenflow is not None:
            self.zenflow.masters_changed()


# The class of the optimizer deepspeed.initialize returns for stages 1 and 2 (what isinstance checks see).
from deepspeed.runtime.engine_parts.returned_optimizers import DeepSpeedZeroOptimizer  # noqa: E402,F401
