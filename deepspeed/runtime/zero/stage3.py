# SPDX-License-Identifier: Apache-2.0
"""ZeRO stage 3: partitioned parameters whose lifetimes hang off module hooks and the backward session.

Every parameter is sharded (``partition_parameters.py``) and grouped into units
(``parameter_units.py``). ``UnitCoordinator`` gathers a unit when a module of it runs
forward and on every backward visit (pre-backward hooks on module outputs), and
releases it when nothing needs it; the session epilogue releases what is left.

``Stage3Gradients`` is the stage-2 gradient sink with units for buckets: a
contribution is added into the unit's rank-major staging buffer (row ``r`` = every
parameter's shard ``r``), a completed unit is reduce-scattered (in fixed unit
order, once all lower units were) and folded into the fp32 gradient partitions, and
the unit's backward hold is dropped. Every backward reduces, so no stale partition
outlives its window and a parameter unused in a step contributes exactly zero.

``Stage3`` is the step side. Each optimizer param group's partition on a rank is the
concatenation, in unit order, of that group's parameter shards; the 16-bit shards
(with optimizer offload; ``param.ds_tensor`` are views of it), the fp32 masters
and the fp32 gradient partition share that layout, so a unit's piece of a group is
one contiguous segment of each. Without offload no 16-bit shard is kept: a gather
casts the unit's piece of the fp32 masters while copying it in, and
``param.ds_tensor`` is a view of the master.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import deepspeed.comm as dist
from deepspeed.runtime.zero.parameter_units import UnitCoordinator, build_units
from deepspeed.runtime.zero.partition_parameters import (ZeroParamStatus, is_zero_param, partition_param,
                                                         write_shard_from_full)
from deepspeed.runtime.zero.partitioned_step import PartitionedStepMixin, master_partition, point_optimizer_at
from deepspeed.runtime.zero.stage_1_and_2 import PartitionedGradients


@dataclass
class UnitSlot:
    bucket: int  # unit index
    unit_offset: int  # offset of the parameter's shard in a unit row
    shard: int
    group: int
    part_offset: int  # offset of the shard in the group partition
    fired_serial: int = -1


class Stage3Layout:
    """Units as buckets, with unit-major group partitions (see the module docstring)."""

    def __init__(self, units, group_of, num_groups, world_size, rank):
        self.world_size = world_size
        self.rank = rank
        self.buckets = units
        self.num_groups = num_groups
        self.slots = {}
        part_numel = [0] * (num_groups + 1)  # the last "group" holds frozen parameters' shards
        for unit in units:
            unit.padded = world_size * unit.chunk
            unit.segments = []
            for param, offset, shard in zip(unit.params, unit.offsets, unit.shard):
                g = group_of.get(param, num_groups)
                if unit.segments and unit.segments[-1][0] == g:
                    seg = unit.segments[-1]
                    unit.segments[-1] = (g, seg[1], seg[2], seg[3] + shard)
                else:
                    unit.segments.append((g, part_numel[g], offset, shard))
                self.slots[param] = UnitSlot(bucket=unit.index,
                                             unit_offset=offset,
                                             shard=shard,
                                             group=g,
                                             part_offset=part_numel[g])
                part_numel[g] += shard
        self.group_part_numel = part_numel[:num_groups]
        self.frozen_part_numel = part_numel[num_groups]
        self.params = [p for u in units for p in u.params if p.requires_grad and p in group_of]


class Stage3Gradients(PartitionedGradients):
    """Gradient sink of a stage-3 engine: reduce-scatter per unit in every backward."""

    coordinator = None

    def _accumulate(self, store, slot, grad, factor):
        buf = self._bucket_buffer(self._staging if store is None else store, slot.bucket)
        world = self.world_size
        rows = buf.view(world, -1).narrow(1, slot.unit_offset, slot.shard)
        flat = grad.reshape(-1)
        if flat.numel() != world * slot.shard:
            flat = F.pad(flat, (0, world * slot.shard - flat.numel()))
        rows.add_(flat.view(world, slot.shard), alpha=factor)

    def _fold(self, unit, out):
        for g, part_offset, unit_offset, length in unit.segments:
            if g < len(self.grad_parts):
                part = self.grad_parts[g].narrow(0, part_offset, length)
                piece = out.narrow(0, unit_offset, length)
                part.add_(piece.to(part.device) if piece.device != part.device else piece)

    def _bucket_complete(self, bucket, run):
        self.coordinator.backward_done(self.layout.buckets[bucket])
        super()._bucket_complete(bucket, run)

    def end_backward(self, session):
        try:
            super().end_backward(session)
        finally:
            self.coordinator.end_backward()

    def abort_backward(self, session):
        try:
            super().abort_backward(session)
        finally:
            if self.coordinator is not None:
                self.coordinator.end_backward()


class Stage3(PartitionedStepMixin):
    """Step side of stage 3; same interface as the other stages."""

    stage = 3

    def __init__(self,
                 module,
                 inner_optimizer,
                 *,
                 accum_dtype,
                 device,
                 group,
                 average,
                 comm_dtype,
                 gas_fn,
                 reduce_now_fn,
                 requires_loss_scale,
                 overlap_comm,
                 use_reduce_scatter,
                 unit_numel,
                 persistence_threshold,
                 model_dtype,
                 offload_optimizer_device=None,
                 offload_param_device=None,
                 pin_memory=False,
                 bucket_numel=None):
        self.group = group
        self.device = device
        self.module = module
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.param_device = torch.device(offload_param_device) if offload_param_device else device
        self.part_device = torch.device(offload_optimizer_device) if offload_optimizer_device else device

        group_of, seen = {}, set()
        for g, param_group in enumerate(inner_optimizer.param_groups):
            for p in param_group["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    group_of[p] = g
        num_groups = len(inner_optimizer.param_groups)
        all_params = list(module.parameters())
        with torch.no_grad():
            for p in all_params:
                if not is_zero_param(p):
                    partition_param(p, world, rank, shard_device=self.param_device, dtype=model_dtype)
                elif p.ds_tensor.dtype != model_dtype:
                    p.ds_tensor = p.ds_tensor.to(model_dtype)
        units = build_units(module, all_params, unit_numel, persistence_threshold, world,
                            {p: group_of.get(p, num_groups)
                             for p in all_params})
        self.layout = layout = Stage3Layout(units, group_of, num_groups, world, rank)
        self.units = units

        # 16-bit shards of every group (and of frozen parameters), unit-major; ds_tensor become views.
        self.shards = [
            torch.zeros(n, dtype=model_dtype, device=self.param_device)
            for n in layout.group_part_numel + [layout.frozen_part_numel]
        ]
        with torch.no_grad():
            for p in all_params:
                slot = layout.slots[p]
                view = self.shards[slot.group].narrow(0, slot.part_offset, slot.shard)
                view.copy_(p.ds_tensor.to(self.param_device))
                p.ds_tensor = view
                p.data = torch.empty(0, dtype=model_dtype, device=device)
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE

        self.grads = Stage3Gradients(layout,
                                     stage=3,
                                     accum_dtype=accum_dtype,
                                     device=device,
                                     part_device=self.part_device,
                                     pin_memory=pin_memory,
                                     group=group,
                                     average=average,
                                     comm_dtype=comm_dtype,
                                     gas_fn=gas_fn,
                                     reduce_now_fn=reduce_now_fn,
                                     requires_loss_scale=requires_loss_scale,
                                     overlap_comm=overlap_comm,
                                     use_reduce_scatter=use_reduce_scatter)
        self.masters = []
        for g in range(num_groups):
            values = self.shards[g].to(self.part_device, torch.float32, copy=True)
            self.masters.append(master_partition(values, self.grads.grad_parts[g], pin_memory))
        point_optimizer_at(inner_optimizer, self.masters, layout.group_part_numel)
        self.model_dtype = model_dtype
        # Where masters live beside the parameters' device, gathers read the fp32 masters and
        # cast while copying in (as FSDP2 does): no 16-bit copy of the shards is kept.
        self.sources = list(self.shards)
        if self.part_device == self.param_device == device:
            for g, master in enumerate(self.masters):
                self.sources[g] = master.data
                self.shards[g] = None
            with torch.no_grad():
                for p in all_params:
                    slot = layout.slots[p]
                    p.ds_tensor = self.sources[slot.group].narrow(0, slot.part_offset, slot.shard)
        self.coordinator = UnitCoordinator(module, units, self._send_chunk, self.grads, group, device)
        self.grads.coordinator = self.coordinator
        self._gather_persistent()

    # ------------------------------------------------------------ gathering
    def _send_chunk(self, unit):
        pieces = [self.sources[g].narrow(0, part_offset, length) for g, part_offset, _, length in unit.segments]
        chunk = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return chunk.to(self.device, self.model_dtype, non_blocking=True)

    def _gather_persistent(self):
        for unit in self.units:
            if unit.persistent:
                self.coordinator.gather(unit)

    # ------------------------------------------------------------------ step
    def optimizer_step(self, inner):
        inner.step()
        with torch.no_grad():
            for g, master in enumerate(self.masters):
                if self.shards[g] is not None:
                    self.shards[g].copy_(master.data)
        self.coordinator.release_all()
        self._gather_persistent()

    def after_forward(self):
        self.coordinator.end_of_first_forward()

    def release(self):
        self.coordinator.remove_hooks()
        super().release()

    # ------------------------------------------------------------- accessors
    def _shard_of(self, buffer, param):
        slot = self.layout.slots[param]
        return buffer.narrow(0, slot.part_offset, slot.shard)

    def _gather(self, shard, param):
        world = self.layout.world_size
        shard = shard.to(self.device, torch.float32)
        if world == 1:
            full = shard
        else:
            full = torch.empty(world * shard.numel(), dtype=torch.float32, device=self.device)
            dist.all_gather_into_tensor(full, shard.contiguous(), group=self.group)
        return full[:param.ds_numel].view(param.ds_shape)

    def _group(self, param):
        return self.layout.slots[param].group

    def full_grad(self, param):
        g = self._group(param)
        if g >= len(self.grads.grad_parts):
            return None
        return self._gather(self._shard_of(self.grads.grad_parts[g], param), param)

    def local_grad(self, param):
        return self._shard_of(self.grads.grad_parts[self._group(param)], param)

    def set_full_grad(self, param, value):
        self._write(self.grads.grad_parts[self._group(param)], param, value)

    def fp32_param(self, param):
        g = self._group(param)
        source = self.masters[g].data if g < len(self.masters) else self.sources[g]  # never the 16-bit shards
        return self._gather(self._shard_of(source, param), param)

    def local_fp32_param(self, param):
        return self._shard_of(self.masters[self._group(param)].data, param)

    def _write(self, buffer, param, value):
        rank = self.layout.rank
        slot = self.layout.slots[param]
        flat = value.reshape(-1)
        start = rank * slot.shard
        take = max(0, min(param.ds_numel - start, slot.shard))
        target = buffer.narrow(0, slot.part_offset, slot.shard)
        target.zero_()
        if take > 0:
            target[:take].copy_(flat[start:start + take])

    def set_fp32_param(self, param, value):
        with torch.no_grad():
            g = self._group(param)
            if g < len(self.masters):
                self._write(self.masters[g].data, param, value)
            write_shard_from_full(param, value)
            if param.ds_status == ZeroParamStatus.AVAILABLE:
                param.data.copy_(value)

    def params_modified(self, param):
        """``param.ds_tensor`` was rewritten (GatheredParameters with a modifier): refresh its master."""
        g = self._group(param)
        if g < len(self.masters):
            with torch.no_grad():
                self._shard_of(self.masters[g].data, param).copy_(param.ds_tensor)

    def optimizer_state(self, inner, param, key):
        master = self.masters[self._group(param)]
        value = inner.state.get(master, {}).get(key)
        if isinstance(value, torch.Tensor) and value.numel() == master.numel():
            return self._gather(self._shard_of(value, param), param)
        return value

    def set_optimizer_state(self, inner, param, key, value):
        master = self.masters[self._group(param)]
        state = inner.state.get(master, {}).get(key)
        if not isinstance(state, torch.Tensor) or state.numel() != master.numel():
            raise KeyError(f"optimizer state '{key}' does not exist for this parameter yet")
        with torch.no_grad():
            self._write(state, param, value.to(state.dtype))

    @torch.no_grad()
    def consolidated_state_dict(self, exclude_frozen_parameters=False):
        """Every parameter's whole 16-bit value and the buffers, by name, on the CPU (a collective)."""
        state = {}
        for name, param in self.module.named_parameters():
            if exclude_frozen_parameters and not param.requires_grad:
                continue
            slot = self.layout.slots[param]
            full = self._gather(self.sources[slot.group].narrow(0, slot.part_offset, slot.shard), param)
            state[name] = full.to(self.model_dtype).cpu()
        for name, buffer in self.module.named_buffers():
            state[name] = buffer.detach().cpu()
        return state
