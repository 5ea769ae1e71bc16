# SPDX-License-Identifier: Apache-2.0
"""ZeRO stage 3: partitioned parameters whose lifetimes hang off module hooks and the backward session.

Every parameter is sharded (``partition_parameters.py``) and grouped into units
(``parameter_units.py``). ``UnitCoordinator`` gathers a unit when a module of it runs
forward and on every backward visit (pre-backward hooks on module outputs), and
releases it when nothing needs it; the session epilogue releases what is left.

Gradients go through the gradient pipeline with one bucket per unit
(:class:`~deepspeed.runtime.zero.gradients.reduction.UnitGeometry`): a contribution is staged into
the unit's rank-major buffer (row ``r`` = every parameter's shard ``r``), a completed unit
drops its backward hold and is reduce-scattered (in fixed unit order, once all lower
units were) into the rank's gradient partitions. Every backward reduces, so no stale
partition outlives its window and a parameter unused in a step contributes exactly zero.

Expert parameters of expert-parallel size > 1 (``deepspeed.moe`` with ``ep_size > 1``, AutoEP) differ
across expert-parallel ranks: each is sharded over its expert-data-parallel group (its
:class:`~deepspeed.runtime.zero.gradients.reduction_spec.ReductionSpec`, from ``deepspeed.utils.groups``), in units of
its own (``build_units`` never mixes groups), gathered and reduce-scattered over that group with the spec's
factor, so the optimizer-visible gradient stays the mean over the global batch. The partitions of all ranks
still cover every parameter of the model once, so the norm and the non-finite verdict, summed over the
data-parallel group, count every expert once. Offload takes them unchanged: an expert unit's segments of the
host partitions and of the 16-bit shards are sized by its group (``UnitPartitionLayout``); ``offload_optimizer``
steps them like any other (the whole step or the unit step), and with ``offload_param`` (CPU or NVMe) the unit's
row is uploaded from its host (or disk) shard and all-gathered over its group like a device row. Expert parameters
``zero.Init`` partitioned over every rank are gathered and re-sharded over their group here. ZeRO++ takes them over
their group (``_zeropp``: the same wire and quantized transport, hpZ on the group's sub-nodes of the node axis);
ZenFlow selects an expert's columns over the group the expert is sharded over (``runtime/zenflow``).

The step side. Each optimizer param group's partition on a rank is the concatenation, in
unit order, of that group's parameter shards (``UnitPartitionLayout``); the 16-bit shards
(kept with optimizer or parameter offload; ``param.ds_tensor`` are views of them), the
fp32 masters and the gradient partitions share that layout, so a unit's piece of a group
is one contiguous segment of each. Without offload no 16-bit shard is kept: a gather casts
the unit's piece of the fp32 masters while copying it in, and ``param.ds_tensor`` is a view
of the master.

With ``offload_optimizer`` and the pipelined host step, ``step()`` returns while the host
steps those segments in the next forward's gather order, and each unit's gather waits for
its own (``unit_step.py``); everything else that reads or writes the step's state completes
it first. With ``offload_optimizer.super_offload`` the units' pieces start in the boundary backward
as their folds complete (``speculative_step.py``) and ``step()`` keeps or rolls them back.
"""

import torch

import deepspeed.comm as dist
from deepspeed.runtime.zenflow.stage_io import UnitIO
from deepspeed.runtime.zenflow.zenflow_step import ZenFlowStep
from deepspeed.runtime.zero.gradients import grad_ops
from deepspeed.runtime.zero.checkpoint.stage3 import Stage3Checkpoint
from deepspeed.runtime.zero.offload.device_share import device_ranges
from deepspeed.runtime.zero.partitions.matrix_step import install_matrix_step, stage3_blocks
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as Kind
from deepspeed.runtime.zero.offload.offload_step import HostStep
from deepspeed.runtime.zero.offload.param_fetch import ShardFetch
from deepspeed.runtime.zero.units.parameter_units import UnitCoordinator, build_units
from deepspeed.runtime.zero.partitions.partition_layout import UnitPartitionLayout
from deepspeed.runtime.zero.partition_parameters import (ZeroParamStatus, is_zero_param, partition_param,
                                                         repartition_param, write_shard_from_full)
from deepspeed.runtime.precision.low_precision_masters import check_optimizer
from deepspeed.runtime.zero.partitions.partitioned_step import (PartitionedOptimizerState, attach_step_grads,
                                                                master_partition, point_optimizer_at)
from deepspeed.runtime.zero.gradients.profiling import ds_range
from deepspeed.runtime.zero.gradients.reduction import UnitGeometry
from deepspeed.runtime.zero.offload.speculative_step import NEEDS_PIPELINED_STEP, SpeculativeStep
from deepspeed.runtime.zero.stage_base import ZeroStage, global_rank, trainable_groups
from deepspeed.runtime.zero.offload.transfers import DONE, pinned
from deepspeed.runtime.zero.offload.unit_step import UnitStep
from deepspeed.runtime.zero.gradients.quantized_reduce import QuantizedReduceScatter, qgz_node_size
from deepspeed.runtime.zero.units.unit_fetch import UnitFetchPlan
from deepspeed.runtime.zero.gradients.transport import GroupTransports
from deepspeed.utils.node_axis import build_expert_node_axis, build_node_axis
from deepspeed.utils.groups import EXPERT_GROUP_PREFIX
from deepspeed.utils.timer import OPTIMIZER_STEP_TIMER


class Stage3(PartitionedOptimizerState, ZeroStage):
    """Stage 3 (see the module docstring)."""

    stage = 3

    def __init__(self, module, optimizer, config, clock, *, device, group, reduction=None):
        super().__init__(config, optimizer, clock, device=device, group=group, reduction=reduction)
        check_optimizer(config, optimizer)
        # Experts of expert-parallel size 1 are held by every rank of the dense group: they are sharded and reduced
        # like dense parameters. Larger sizes are partitioned, gathered and reduced over their expert-data-parallel
        # group (their ReductionSpec), in units of their own.
        # (frozen experts too: their shards differ by expert-parallel rank like the trained ones')
        self._expert_specs = {
            p: self.reduction.spec_of(p)
            for p in module.parameters()
            if not getattr(p, "allreduce", True) and getattr(p, "group_name", None) != EXPERT_GROUP_PREFIX + "1"
        }
        self.module = module
        world, rank = self.world_size, self.rank
        model_dtype = config.model_dtype
        self.model_dtype = model_dtype
        self.param_device = torch.device(config.offload_param) if config.offload_param else self.device
        self.part_device = torch.device(config.offload_optimizer) if config.offload_optimizer else self.device

        group_of = {p: g for g, params in enumerate(trainable_groups(optimizer)) for p in params}
        num_groups = len(optimizer.param_groups)
        all_params = list(module.parameters())
        with torch.no_grad():
            for p in all_params:
                spec = self._expert_specs.get(p)
                if is_zero_param(p) and spec is not None and getattr(p, "ds_partition_world", None) is None:
                    # built under zero.Init, which shards over every rank: over its expert-data-parallel group now
                    repartition_param(p, spec.world_size, spec.rank, spec.group)
                if not is_zero_param(p):
                    partition_param(p,
                                    world if spec is None else spec.world_size,
                                    rank if spec is None else spec.rank,
                                    shard_device=self.param_device,
                                    dtype=model_dtype,
                                    group=None if spec is None else spec.group,
                                    own_group=spec is not None)
                elif hasattr(p, "ds_quant_store"):  # quantized frozen by an earlier engine: its dequantized shard
                    p.ds_tensor = p.ds_quant_store.shard_values(p, model_dtype)
                    del p.ds_quant_store
                elif p.ds_tensor.dtype != model_dtype:
                    p.ds_tensor = p.ds_tensor.to(model_dtype)
        units = build_units(module,
                            all_params,
                            config.unit_numel,
                            config.persistence_threshold,
                            world, {p: group_of.get(p, num_groups)
                                    for p in all_params},
                            expert_spec_of=self._expert_specs.get)
        self.units = units
        self.layout = layout = UnitPartitionLayout(units, group_of, num_groups, world, rank)

        # 16-bit shards of every group (and of frozen parameters), unit-major; ds_tensor become views.
        self.shards = [
            pinned(torch.zeros(n, dtype=model_dtype, device=self.param_device), config.param_pin_memory)
            for n in layout.group_part_numel + [layout.frozen_part_numel]
        ]
        with torch.no_grad():
            for p in all_params:
                view = layout.shard_view(self.shards[layout.slots[p].group], p)
                view.copy_(p.ds_tensor.to(self.param_device))
                p.ds_tensor = view
                p.data = torch.empty(0, dtype=model_dtype, device=device)
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE

        # ZeRO++ quantized frozen weights (``frozen_quant.py``): the frozen shards become int8 codes and scales
        self.frozen_store = None
        if config.zeropp.quantized_nontrainable_weights:
            self.frozen_store = self._quantize_frozen(units, all_params, group_of)
        grad_transport, fetch, expert_fetch = self._zeropp(config.zeropp, group, world)
        geometry = UnitGeometry(units,
                                layout,
                                use_reduce_scatter=config.use_reduce_scatter,
                                transport=grad_transport,
                                **self._geometry_args(self.part_device if config.offload_optimizer else None))
        self._build_pipeline(geometry,
                             reduce_in_every_backward=True,
                             in_flight_limit=self._in_flight_limit(),
                             on_bucket_complete=self._unit_complete,
                             on_backward_end=self._backward_end)
        # a tensor-parallel model's replicated parameters: summed over the tensor-parallel group once per window
        geometry.set_replicas(p for p in module.parameters() if p.requires_grad and p in group_of)
        if geometry.replica_pieces() and (config.offload_optimizer or config.offload_param):
            self.release()
            raise NotImplementedError("tensor parallelism (AutoTP) with ZeRO-3 offload_optimizer / offload_param is "
                                      "not supported; see docs/tensor_parallel.md")
        self.masters = []
        for g in range(num_groups):
            values = self.shards[g].to(self.part_device, config.master_dtype, copy=True)
            self.masters.append(master_partition(values, geometry.grad_parts[g], config.pin_masters))
        point_optimizer_at(optimizer, self.masters, layout.group_part_numel)
        install_matrix_step(self, lambda muon_groups: stage3_blocks(layout, muon_groups))
        # Where masters live beside the parameters' device, gathers read the fp32 masters and
        # cast while copying in (as FSDP2 does): no 16-bit copy of the shards is kept.
        self.sources = list(self.shards)
        if not config.offload_optimizer and not config.offload_param:
            for g, master in enumerate(self.masters):
                self.sources[g] = master.data
                self.shards[g] = None
            self._point_ds_tensors()
        # Offload: host shards reach the device through asynchronous copies; host masters are stepped by
        # a HostStep that writes host shards directly, or pinned buffers uploaded to device shards.
        self.fetch = None
        if config.offload_param:
            self.fetch = ShardFetch(self.device,
                                    model_dtype,
                                    buffer_count=config.param_buffer_count,
                                    buffer_numel=config.param_buffer_numel,
                                    largest_row=max([u.chunk for u in units] + [1]))
        self.host_step = None
        if config.offload_optimizer:
            host_shards = bool(config.offload_param)
            self.host_step = HostStep(optimizer,
                                      self.masters,
                                      model_dtype,
                                      self.device,
                                      pin_memory=config.pin_memory,
                                      cores_perc=config.cpu_cores_perc,
                                      targets=self.shards[:num_groups] if host_shards and not config.zenflow else None,
                                      device_ranges=device_ranges(self.masters, config.offload_ratio),
                                      disk=config.optimizer_swap,
                                      page_table=self._page_table(),
                                      rank=global_rank())
            self._host_shards = host_shards
        self.coordinator = UnitCoordinator(module,
                                           units,
                                           self._send_chunk,
                                           self.pipeline,
                                           group,
                                           device,
                                           fetch=fetch,
                                           expert_fetch=expert_fetch,
                                           read_ahead=self._read_ahead if config.param_swap is not None else None)
        # The pipelined host step overlaps the next forward (``unit_step.py``); whatever else reads or writes
        # what it touches completes it first: the next backward's folds into the gradient partitions (their
        # barrier), state_dict (a pre-hook on every module), the accessors and the rest (``_step_done``).
        self.unit_step = None
        self._state_dict_hooks = []
        if (self.host_step is not None and self.host_step.pipeline is not None and config.zenflow is None
                and config.accum_dtype == torch.float32 and config.master_dtype == torch.float32):
            self.unit_step = UnitStep(self)
            geometry.folder.barrier = self.host_step.finish
            for sub in module.modules():
                self._state_dict_hooks.append(sub.register_state_dict_pre_hook(self._state_dict_pre_hook))
        # Speculative steps (``super_offload``, ``speculative_step.py``): a unit's pieces start in the boundary
        # backward once its fold completes; under parameter offload their 16-bit values wait for the verdict
        # (staged), since the backward's re-gathers read the host shards.
        if config.super_offload:  # (with ``offload_optimizer.ratio`` < 1 StageConfig has raised already)
            if self.unit_step is None:
                self.release()
                raise NotImplementedError(NEEDS_PIPELINED_STEP)
            self.speculative = SpeculativeStep(self,
                                               pieces=lambda stage: stage.unit_step.speculative_pieces(),
                                               staged_targets=self._host_shards)
        self._gather_persistent()
        # ZenFlow (``runtime/zenflow``) replaces the step: the top columns on the device every step, the rest on the
        # host once per window.
        self.zenflow = ZenFlowStep(self, config.zenflow, UnitIO(self)) if config.zenflow is not None else None
        # NVMe parameter offload (``param_swap.py``): the 16-bit shards go to disk, gathers read them page by page.
        self.param_tier = None
        if config.param_swap is not None:
            from deepspeed.runtime.swap_tensor.param_swap import ParamShardSwap
            self.param_tier = ParamShardSwap(self, self._page_table(), config.param_swap, global_rank())
            if self.host_step is not None:
                self.host_step.attach_shard_tier(self.param_tier)
            self.param_tier.swap_out()

    def _zeropp(self, zeropp, group, world):
        """ZeRO++ (``zeropp.py``): ``(gradient transport, unit fetch plan, expert fetch plans)``. The node axis (a
        mesh axis, built by ``deepspeed.utils.node_axis``) serves hpZ's secondary shards (``unit_fetch.py``) and
        qgZ's two hops (``quantized_reduce.py``); with neither, the default transport and a plain fetch.

        Expert units (of expert-parallel size > 1) take the same wire and transport over their expert-data-parallel
        group, and as node axis that group's sub-nodes (its members inside one node of the ZeRO group's axis,
        ``build_expert_node_axis``); where a sub-node is one rank or the sub-nodes are irregular they have none: hpZ
        then gathers them over their group in the backward too, and qgZ reduces them in one hop."""
        nodes = zeropp.hpz_partition_size
        if zeropp.quantized_weights or zeropp.quantized_gradients or zeropp.quantized_nontrainable_weights:
            from deepspeed.ops import block_quant_native
            block_quant_native.register(self.device)  # the host op for a CPU engine (measured faster there)
        if zeropp.quantized_gradients and nodes == 1 and group is None:
            nodes = qgz_node_size(world)  # hpZ off: qgZ's first hop stays inside a host
        node_axis = build_node_axis(nodes, cross=zeropp.quantized_gradients) if nodes > 1 and world > 1 else None
        specs = {spec.name: spec for spec in self._expert_specs.values() if spec.world_size > 1}
        expert_axes = {
            name: build_expert_node_axis(name, node_axis.size, cross=zeropp.quantized_gradients)
            for name in sorted(specs)
        } if node_axis is not None else {}
        grad_transport = None
        if zeropp.quantized_gradients:
            grad_transport = QuantizedReduceScatter(world, node_axis)
            if specs:
                grad_transport = GroupTransports(
                    grad_transport, [(spec.group, QuantizedReduceScatter(spec.world_size, expert_axes.get(name)))
                                     for name, spec in sorted(specs.items())])
        hpz = zeropp.hpz_partition_size > 1
        fetch = UnitFetchPlan(group,
                              world,
                              quantized_weights=zeropp.quantized_weights,
                              node_axis=node_axis if hpz else None,
                              frozen=self.frozen_store)
        expert_fetch = {
            name:
            UnitFetchPlan(spec.group,
                          spec.world_size,
                          quantized_weights=zeropp.quantized_weights,
                          node_axis=expert_axes.get(name) if hpz else None,
                          frozen=self.frozen_store)
            for name, spec in specs.items()
        }
        return grad_transport, fetch, expert_fetch

    def _quantize_frozen(self, units, all_params, group_of):
        """The :class:`FrozenQuantStore` of the frozen shards; the 16-bit frozen partition is freed."""
        from deepspeed.runtime.zero.units.frozen_quant import FrozenQuantStore
        loose = [p for p in all_params if p.requires_grad and p not in group_of]
        if loose:
            raise NotImplementedError("zero_optimization.zero_quantized_nontrainable_weights quantizes the frozen "
                                      f"(requires_grad=False) parameters; {len(loose)} parameter(s) require a "
                                      "gradient but are in no optimizer param group: freeze them or give them to the "
                                      "optimizer - see docs/zero.md")
        frozen = len(self.shards) - 1
        store = FrozenQuantStore(units, self.layout, self.shards[frozen], self.model_dtype, self.param_device)
        self.shards[frozen] = None
        return store

    def _page_table(self):
        """The pages of the disk tiers (``device: nvme``): each unit's segment of each group (the frozen parameters
        last), cut to the smaller page size of the two tiers; one table, so both number a page alike."""
        config = self.config
        sizes = [c.page_numel for c in (config.optimizer_swap, config.param_swap) if c is not None]
        if not sizes:
            return None
        if getattr(self, "_pages", None) is None:
            from deepspeed.runtime.swap_tensor.paged_store import PageTable
            layout = self.layout
            pieces = [[] for _ in range(layout.num_groups + 1)]
            for unit in self.units:
                for g, part_offset, _, length in layout.segments[unit.index]:
                    pieces[g].append((part_offset, length))
            self._pages = PageTable(pieces, min(sizes))
        return self._pages

    def _read_ahead(self, units):
        if self.param_tier is not None and not self.param_tier.resident:
            self.param_tier.read_ahead_units(units)

    @property
    def grad_parts(self):
        return self.geometry.partitions()

    def _extra_sq_norm(self):
        """Every tensor-parallel rank holds the same shards of the replicated parameters: count them once."""
        pieces = self.geometry.replica_pieces()
        if not pieces:
            return 0.0
        tp = self.reduction.tensor[next(iter(self.reduction.tensor))].tensor_size
        return -(1.0 - 1.0 / tp) * grad_ops.partial_sq_norm(pieces, device=self.device)

    # ------------------------------------------------------------ gathering
    def _send_chunk(self, unit, out):
        """``(row, ready)``: this rank's row of ``unit`` in the model dtype on the device (in ``out`` when given),
        and the copy it waits for.

        Device sources (the fp32 masters or device shards) are cast in one pass (``ready`` is DONE); host
        shards are uploaded asynchronously (:class:`ShardFetch`).
        """
        if self.unit_step is not None:
            self.unit_step.wait_for(unit)
        tier = getattr(self, "param_tier", None)
        if tier is not None and not tier.resident:
            return tier.fetch_row(unit, out)
        segments = self.layout.segments[unit.index]
        tail = self.frozen_store.tail(unit.index) if self.frozen_store is not None else None
        if tail is not None:  # the frozen columns travel as stored (quantized): only the trainable ones are sent
            segments = segments[:-1]
        pieces = [self.sources[g].narrow(0, part_offset, length) for g, part_offset, _, length in segments]
        if tail is not None:  # (no parameter offload here: refused with this key)
            numel = unit.chunk - tail.length
            if out is None:
                row = torch.empty(numel, dtype=self.model_dtype, device=self.device)
            else:  # a world of one: the whole unit, frozen columns dequantized in place
                row = out.narrow(0, 0, numel)
                self.frozen_store.decode_local(tail, out.narrow(0, numel, tail.length))
            if pieces:
                grad_ops.pack_cast(pieces, row)
            return (row if out is None else out), DONE
        if self.fetch is None:
            row = torch.empty(unit.chunk, dtype=self.model_dtype, device=self.device) if out is None else out
            grad_ops.pack_cast(pieces, row)
            return row, DONE
        return self.fetch.fetch([(piece, column) for piece, (_, _, column, _) in zip(pieces, segments)],
                                unit.chunk,
                                out=out)

    def _gather_persistent(self):
        for unit in self.units:
            if unit.persistent:
                self.coordinator.gather(unit)

    def _unit_complete(self, bucket):
        self.coordinator.backward_done(self.units[bucket.index])

    def _backward_end(self, reduced):
        self.coordinator.end_backward()

    # ------------------------------------------------------------------ step
    def optimizer_step(self):
        if self.param_tier is not None:  # something made the shards resident since the last step: to disk first
            self.param_tier.swap_out()
        if self.zenflow is not None:
            with ds_range("DS::step"), self.timed(OPTIMIZER_STEP_TIMER):
                self.zenflow.step()
            return
        if self.unit_step is not None:
            with ds_range("DS::step"), self.timed(OPTIMIZER_STEP_TIMER):
                grad_scale = self._take_grad_scale()
                begun = None
                if self.speculative is not None:
                    begun = self.speculative.verdict(grad_scale, before_write=self.fetch)
                self.unit_step.launch(grad_scale, begun=begun)
            # the gathered copies are stale; the persistent unit's gather waits for its pieces (stepped first)
            self.coordinator.release_all()
            self._gather_persistent()
            return
        with ds_range("DS::step"), self.timed(OPTIMIZER_STEP_TIMER):
            attached = attach_step_grads(self.masters, self.grad_parts)
            if self.host_step is not None:
                self.host_step.step(before_write=self.fetch if self._host_shards else None,
                                    grad_scale=self._take_grad_scale())
            else:
                self.optimizer.step()
            for master in attached:
                master.grad = None
        self.refresh_16bit()

    @torch.no_grad()
    def refresh_16bit(self):
        """After the masters changed (a step, a load): the 16-bit shards, then re-gather the persistent units."""
        tier = self.param_tier
        if tier is not None and not tier.resident:  # the shards stay on disk: the masters' values go to their pages
            if self.host_step is not None:
                self.host_step.finish()
                if not self.host_step.fresh:  # the step did not write them itself
                    self.host_step.sync_host()
                    for g, master in enumerate(self.masters):
                        tier.write_from(g, master.data)
                self.host_step.fresh = False
            else:
                for g, master in enumerate(self.masters):
                    tier.write_from(g, master.data)
            tier.finish_writes()
            self.coordinator.release_all()
            self._gather_persistent()
            return
        self._step_done()
        if getattr(self, "zenflow", None) is not None:  # its host step writes buffers of its own, not the shards
            self.host_step.fresh = False
            self.zenflow.io.apply_host()
        elif self.host_step is not None and self._host_shards:
            if not self.host_step.fresh:  # the step writes the host shards itself
                self.host_step.refresh(before_write=self.fetch)
            self.host_step.fresh = False
        elif self.host_step is not None:
            self.host_step.upload(self.shards[:len(self.masters)])
        else:
            if self.fetch is not None:
                self.fetch.synchronize()
            dsts = [s for s in self.shards[:len(self.masters)] if s is not None]
            srcs = [m.data for s, m in zip(self.shards, self.masters) if s is not None]
            grad_ops.cast_copy(dsts, srcs)
        self.coordinator.release_all()
        self._gather_persistent()

    def after_forward(self):
        self.coordinator.end_of_first_forward()

    def compiled(self):
        self.coordinator.reinstall_hooks()

    def _step_done(self):
        """Before the 16-bit shards, the masters or the moments are read or written outside a gather: an
        overlapped step still running completes, and shards on disk are read back into host tensors."""
        if self.host_step is not None:
            self.host_step.finish()
        if getattr(self, "param_tier", None) is not None:
            self.param_tier.swap_in()

    shards_current = _step_done  # what ``GatheredParameters`` calls before it reads or writes ``ds_tensor``

    def empty_partition_cache(self):
        """Release every gathered unit no forward or backward holds (a prefetch in flight is completed first),
        persistent units (under ``stage3_param_persistence_threshold``) included, as upstream: those are gathered
        again when the next forward or backward begins."""
        self._step_done()
        self.coordinator.release_unused(persistent=True)

    def _state_dict_pre_hook(self, *_args, **_kwargs):
        self._step_done()

    def release(self):
        if self.speculative is not None:
            self.speculative.close()
        if getattr(self, "zenflow", None) is not None:
            self.zenflow.close()
        for handle in self._state_dict_hooks:
            handle.remove()
        self._state_dict_hooks = []
        self.coordinator.remove_hooks()
        try:
            if self.host_step is not None:
                self.host_step.close()
        finally:
            if getattr(self, "param_tier", None) is not None:
                self.param_tier.close()
                self.param_tier = None
        super().release()

    def checkpoint(self):
        self._masters_current()
        return Stage3Checkpoint(self)

    # ------------------------------------------------------------ state table
    def state_table(self):
        table = super().state_table()
        if not self.config.offload_param:  # the 16-bit shards (or the masters gathers read) and their views
            table[Kind.lp_params] = [s for s in self.sources if s is not None] + \
                [p.ds_tensor for p in self.module.parameters() if not hasattr(p, "ds_quant_store")]
        return table

    _own_shards = False  # 16-bit shards made for an offload of the masters alone (see before_offload)

    def before_offload(self, include):
        """Also: every gathered copy is released (persistent units too), and when the masters move but the
        parameters stay, the parameters get 16-bit shards of their own (cast from the masters, as a gather
        casts them), so forwards and ``GatheredParameters`` keep working while the masters are away."""
        super().before_offload(include)
        self._step_done()
        self.coordinator.release_all()
        if Kind.hp_params in include and Kind.lp_params not in include and not self._own_shards:
            shared = [g for g, s in enumerate(self.shards[:len(self.masters)]) if s is None]
            if shared and not self.config.offload_param:
                for g in shared:
                    self.shards[g] = self.masters[g].data.to(self.model_dtype, copy=True)
                    self.sources[g] = self.shards[g]
                self._own_shards = shared
                self._point_ds_tensors()

    def after_offload(self, offloaded):
        """Parameters still on the device: their persistent units are gathered again, as after a step."""
        if Kind.lp_params not in offloaded:
            self._gather_persistent()

    def after_reload(self):
        """The gathers read the masters again (dropping shards :meth:`before_offload` made); the persistent units
        are gathered again."""
        if self._own_shards:
            for g in self._own_shards:
                self.shards[g] = None
                self.sources[g] = self.masters[g].data
            self._own_shards = False
            self._point_ds_tensors()
        self._gather_persistent()

    @torch.no_grad()
    def _point_ds_tensors(self):
        layout = self.layout
        for p in self.module.parameters():
            if not hasattr(p, "ds_quant_store"):  # a quantized frozen shard keeps its codes
                p.ds_tensor = layout.shard_view(self.sources[layout.slots[p].group], p)

    def _masters_current(self):
        super()._masters_current()
        if self.host_step is not None:
            self.host_step.sync_host()
        if getattr(self, "zenflow", None) is not None:
            self.zenflow.sync_masters()
        if getattr(self, "param_tier", None) is not None:
            self.param_tier.swap_in()  # checkpoints and accessors read the 16-bit shards too

    # ------------------------------------------------------------- accessors
    def _shard_of(self, buffer, param):
        return self.layout.shard_view(buffer, param)

    def _gather(self, shard, param):
        """``param``'s whole value from its shards (a collective over the group it is partitioned over)."""
        spec = self._expert_specs.get(param)
        world = self.layout.world_size if spec is None else spec.world_size
        group = self.group if spec is None else spec.group
        shard = shard.to(self.device, torch.float32)
        if world == 1:
            full = shard
        else:
            full = torch.empty(world * shard.numel(), dtype=torch.float32, device=self.device)
            dist.all_gather_into_tensor(full, shard.contiguous(), group=group)
        return full[:param.ds_numel].view(param.ds_shape)

    def _group(self, param):
        return self.layout.slots[param].group

    def _gather_from(self, buffer, param):
        return self._gather(self._shard_of(buffer, param), param)

    def full_grad(self, param):
        g = self._group(param)
        if g >= len(self.grad_parts):
            return None
        return self._gather(self._shard_of(self.grad_parts[g], param), param)

    def local_range(self, param):
        slot = self.layout.slots[param]
        shard = slot.shard
        start = min(slot.rank * shard, param.ds_numel)
        return start, max(0, min(param.ds_numel - start, shard))

    def local_grad(self, param):
        return self._shard_of(self.grad_parts[self._group(param)], param)

    def set_full_grad(self, param, value):
        self._write(self.grad_parts[self._group(param)], param, value)

    def fp32_param(self, param):
        self._masters_current()
        g = self._group(param)
        if g < len(self.masters):  # never the 16-bit shards
            return self._gather(self._shard_of(self.masters[g].data, param), param)
        return self._gather(self.shard_16bit(param), param)

    def shard_16bit(self, param):
        """This rank's shard of ``param`` in the model dtype (a quantized frozen one dequantized)."""
        if hasattr(param, "ds_quant_store"):
            return param.ds_quant_store.shard_values(param, self.model_dtype)
        return self._shard_of(self.sources[self._group(param)], param)

    def frozen_partition(self):
        """The frozen parameters' 16-bit partition (a dequantized copy when they are stored quantized)."""
        if self.frozen_store is not None:
            return self.frozen_store.partition_values(self.module.parameters())
        return self.sources[len(self.masters)]

    def load_frozen_partition(self, values):
        if self.frozen_store is not None:
            self.frozen_store.load_partition(self.module.parameters(), values)
        else:
            self.sources[len(self.masters)].copy_(values)

    def local_fp32_param(self, param):
        self._masters_current()
        return self._shard_of(self.masters[self._group(param)].data, param)

    def _write(self, buffer, param, value):
        slot = self.layout.slots[param]
        rank = slot.rank
        flat = value.reshape(-1)
        start = rank * slot.shard
        take = max(0, min(param.ds_numel - start, slot.shard))
        target = buffer.narrow(0, slot.part_offset, slot.shard)
        target.zero_()
        if take > 0:
            target[:take].copy_(flat[start:start + take])

    def set_fp32_param(self, param, value):
        self._masters_current()
        self.coordinator.invalidate_secondary()  # hpZ's secondary shards hold the old values
        with torch.no_grad():
            g = self._group(param)
            if g < len(self.masters):
                self._write(self.masters[g].data, param, value)
            write_shard_from_full(param, value)
            if param.ds_status == ZeroParamStatus.AVAILABLE:
                if hasattr(param, "ds_quant_store"):  # what a gather of the new codes gives
                    world = getattr(param, "ds_partition_world", None) or self.world_size  # an expert's group
                    value = param.ds_quant_store.round_trip_full(param, value.to(param.data.device), world)
                param.data.copy_(value)
        if self.zenflow is not None:
            self.zenflow.masters_changed()

    def params_modified(self, param):
        """``param.ds_tensor`` was rewritten (GatheredParameters with a modifier): refresh its master."""
        self.coordinator.invalidate_secondary()  # hpZ's secondary shards hold the old values
        g = self._group(param)
        if g < len(self.masters):
            self._masters_current()
            with torch.no_grad():
                self._shard_of(self.masters[g].data, param).copy_(param.ds_tensor)

    @torch.no_grad()
    def consolidated_state_dict(self, exclude_frozen_parameters=False):
        """Every parameter's whole 16-bit value and the buffers, by name, on the CPU (a collective)."""
        self._step_done()
        state = {}
        for name, param in self.module.named_parameters():
            if exclude_frozen_parameters and not param.requires_grad:
                continue
            full = self._gather(self.shard_16bit(param), param)
            state[name] = full.to(self.model_dtype).cpu()
        for name, buffer in self.module.named_buffers():
            state[name] = buffer.detach().cpu()
        return state


# The class of the optimizer deepspeed.initialize returns for stage 3 (what isinstance checks see).
from deepspeed.runtime.engine_parts.returned_optimizers import DeepSpeedZeroOptimizer_Stage3  # noqa: E402,F401
from deepspeed.runtime.zero.units.generation import unwrap_model_for_generation  # noqa: E402,F401
