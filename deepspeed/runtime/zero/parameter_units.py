# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3 communication units and their lifetimes.

A *unit* is a set of parameters gathered with one all-gather and reduced with one
reduce-scatter (FSDP2's parameter group). Units are chosen from the module tree:
walking it children-first, a module whose subtree holds at least ``unit_numel``
elements becomes the root of a unit of its parameters not yet in a unit (so with
``unit_numel`` near a block's size, a transformer block is one unit); containers
without a forward (``ModuleList``, ``ModuleDict``) never root a unit, and the root
module takes what is left. A parameter registered in several
modules (tied weights) goes to the root unit. Small parameters
(``numel <= stage3_param_persistence_threshold``) form one *persistent* unit that
is gathered once and never released.

Unit chunk layout: each parameter is padded to ``W * s`` elements (``s`` its shard
size); the unit's rank-major buffer is ``W`` rows of ``C = sum(s)`` elements, row
``r`` holding every parameter's shard ``r``. Row ``r`` is exactly rank ``r``'s
piece, so gather and reduce are single equal-chunk collectives.

Lifetimes. ``UnitCoordinator`` keeps, per unit, the forward uses outstanding
(module pre/post-forward hooks: the unit root and every module owning parameters of
the unit, so calling a submodule directly works) and a *backward hold* (set by a
pre-backward hook on the outputs of those modules, on every backward visit, so a
second backward over a retained graph gathers again). A unit is released when it
has no forward use, no backward hold, and is not persistent. The stage's gradient
sink clears a unit's hold once all its trainable parameters delivered their
gradient in the running backward; the session epilogue clears whatever is left.
"""

import functools

import torch

import deepspeed.comm as dist
from deepspeed.runtime.backward import registry
from deepspeed.runtime.backward.ownership import tensors_in
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus


class ParamUnit:
    """Parameters gathered and reduced together (see the module docstring)."""

    def __init__(self, index, root, params, world_size, persistent=False):
        self.index = index
        self.root = root
        self.params = params
        self.persistent = persistent
        self.world_size = world_size
        self.shard = [p.ds_shard_numel for p in params]
        self.offsets = []
        offset = 0
        for s in self.shard:
            self.offsets.append(offset)
            offset += s
        self.chunk = offset
        self.trainable = sum(1 for p in params if p.requires_grad)
        self.segments = []  # (group, part_offset, unit_offset, length), filled by the stage
        self.fwd_refs = 0
        self.bwd_hold = False
        self.gathered = False
        self._inflight = None  # (work, gather buffer)
        self._full = None
        self.fired_serial = -1
        self.fired = 0


class UnitCoordinator:
    """Gathers, releases and prefetches units, driven by module hooks and the backward session."""

    def __init__(self, module, units, send_chunk_fn, participant, group, device):
        self.module = module
        self.units = units
        self._send_chunk = send_chunk_fn
        self.participant = participant
        self.group = group
        self.device = device
        self.world_size = units[0].world_size if units else 1
        self._handles = []
        self._units_of_module = {}
        self._trace = []  # unit order of the first forward, for prefetching
        self._tracing = True
        self._position = {}
        self._install_hooks()

    # ----------------------------------------------------------------- hooks
    def _install_hooks(self):
        unit_of_param = {p: u for u in self.units for p in u.params}
        for module in self.module.modules():
            units = []
            for unit in self.units:
                if unit.root is module and unit not in units:
                    units.append(unit)
            own = list(module.parameters(recurse=False)) + list(getattr(module, "_ds_external_params", []))
            for param in own:
                unit = unit_of_param.get(param)
                if unit is not None and unit not in units:
                    units.append(unit)
            units = [u for u in units if not u.persistent]
            if not units:
                continue
            self._units_of_module[module] = units
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._pre_forward, units)))
            self._handles.append(module.register_forward_hook(functools.partial(self._post_forward, units)))

    def remove_hooks(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre_forward(self, units, module, inputs):
        # A forward inside a backward is an activation-checkpoint recompute. It takes no forward
        # reference: a non-reentrant recompute stops early by raising inside the forward once it
        # has every saved tensor, so its post-forward hook may never run. The backward hold set by
        # the pre-backward hook (or the session epilogue) keeps and releases the unit instead.
        # A recompute also follows the backward order: it neither traces nor prefetches.
        if torch._C._current_graph_task_id() >= 0:
            for unit in units:
                self.gather(unit)
            return
        for unit in units:
            unit.fwd_refs += 1
            self.gather(unit)
            if self._tracing and unit.index not in self._position:
                self._position[unit.index] = len(self._trace)
                self._trace.append(unit)
            elif not self._tracing:
                self._prefetch_after(unit, forward=True)

    def _post_forward(self, units, module, inputs, output):
        if torch._C._current_graph_task_id() < 0:
            for unit in units:
                unit.fwd_refs -= 1
        if torch.is_grad_enabled():
            tensors = [t for t in tensors_in(output) if t.requires_grad]
            if tensors:
                hook = functools.partial(self._pre_backward, units)
                for t in tensors:
                    t.register_hook(hook)
        for unit in units:
            self._maybe_release(unit)

    def _pre_backward(self, units, grad):
        session = registry.session_for_current_task()
        if session is not None:
            session.factor_for(self.participant)
        for unit in units:
            unit.bwd_hold = True
            self.gather(unit)
            self._prefetch_after(unit, forward=False)
        return None

    def end_of_first_forward(self):
        """The trace of the first forward is complete; from now on prefetch along it."""
        if self._trace:
            self._tracing = False

    # ------------------------------------------------------------- lifetimes
    def backward_done(self, unit):
        """All trainable parameters of ``unit`` delivered their gradient in this backward."""
        unit.bwd_hold = False
        self._maybe_release(unit)

    def end_backward(self):
        """Session epilogue: drop every backward hold and release what nobody needs (also prefetches)."""
        for unit in self.units:
            unit.bwd_hold = False
            if unit._inflight is not None and unit.fwd_refs <= 0:
                self._finish_inflight(unit)
            self._maybe_release(unit)

    def release_all(self):
        """Drop every gathered copy, persistent ones too (their shards changed: the step updated them)."""
        for unit in self.units:
            unit.fwd_refs = 0
            unit.bwd_hold = False
            self._finish_inflight(unit)
            self._release(unit)

    def _maybe_release(self, unit):
        if unit.fwd_refs <= 0 and not unit.bwd_hold and not unit.persistent and unit.gathered:
            self._release(unit)

    def _release(self, unit):
        for param in unit.params:
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)
            param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        if unit._full is not None:
            # Free the memory in place: autograd may hold views of these parameters (a linear
            # saves weight.t()); they keep the storage object, not its memory, and see the
            # values again once the next gather refills the same storage.
            unit._full.untyped_storage().resize_(0)
        unit.gathered = False

    # ---------------------------------------------------------------- gather
    def _launch_gather(self, unit):
        send = self._send_chunk(unit)
        if self.world_size == 1:
            unit._inflight = (None, send)
            return
        buffer = torch.empty(self.world_size * unit.chunk, dtype=send.dtype, device=self.device)
        work = dist.all_gather_into_tensor(buffer, send, group=self.group, async_op=True)
        unit._inflight = (work, buffer)
        for param in unit.params:
            param.ds_status = ZeroParamStatus.INFLIGHT

    def _finish_inflight(self, unit):
        if unit._inflight is None:
            return False
        work, buffer = unit._inflight
        unit._inflight = None
        if work is not None:
            work.wait()
        rows = buffer.view(self.world_size, unit.chunk)
        full = unit._full
        if full is None:
            total = sum(self.world_size * s for s in unit.shard)
            full = unit._full = torch.empty(total, dtype=buffer.dtype, device=self.device)
            unit._views = []
            at = 0
            for param, s in zip(unit.params, unit.shard):
                padded = full.narrow(0, at, self.world_size * s)
                unit._views.append((padded, padded[:param.ds_numel].view(param.ds_shape)))
                at += self.world_size * s
        else:
            full.untyped_storage().resize_(full.numel() * full.element_size())
        with torch.no_grad():
            for param, off, s, (padded, view) in zip(unit.params, unit.offsets, unit.shard, unit._views):
                padded.view(self.world_size, s).copy_(rows[:, off:off + s])
                param.data = view
                param.ds_status = ZeroParamStatus.AVAILABLE
        unit.gathered = True
        return True

    def gather(self, unit):
        """Make ``unit``'s parameters whole (a collective, unless already gathered or in flight)."""
        if unit.gathered:
            return
        if unit._inflight is None:
            self._launch_gather(unit)
        self._finish_inflight(unit)

    def _prefetch_after(self, unit, forward):
        position = self._position.get(unit.index)
        if position is None:
            return
        nxt = position + 1 if forward else position - 1
        if 0 <= nxt < len(self._trace):
            candidate = self._trace[nxt]
            if not candidate.gathered and candidate._inflight is None and not candidate.persistent:
                self._launch_gather(candidate)


def build_units(module, params, unit_numel, persistence_threshold, world_size, group_of):
    """Choose the units of ``module`` for the partitioned ``params`` (see the module docstring)."""
    wanted = set(params)
    registered = {}
    for sub in module.modules():
        for param in sub.parameters(recurse=False):
            registered[param] = registered.get(param, 0) + 1
    persistent = [p for p in params if p.ds_numel <= persistence_threshold]
    taken = set(persistent)
    shared = [p for p in params if registered.get(p, 0) > 1 and p not in taken]
    taken.update(shared)
    groups = []  # (root module, params)
    seen = set()

    def visit(sub):
        if sub in seen:
            return []
        seen.add(sub)
        pending = []
        for child in sub.children():
            pending += visit(child)
        for param in sub.parameters(recurse=False):
            if param in wanted and param not in taken:
                taken.add(param)
                pending.append(param)
        # A module whose whole subtree reaches unit_numel roots a unit of what is left in it (a
        # transformer block); containers never run forward themselves, so they pass their rest up.
        if (sub is not module and pending and not isinstance(sub, (torch.nn.ModuleList, torch.nn.ModuleDict))
                and sum(p.ds_numel for p in sub.parameters() if p in wanted) >= unit_numel):
            groups.append((sub, pending))
            return []
        return pending

    rest = visit(module) + shared
    if rest:
        groups.append((module, rest))
    order = {p: i for i, p in enumerate(module.parameters())}
    # Fixed unit order, the same on every rank: reverse registration (about backward order).
    groups.sort(key=lambda g: min(order.get(p, 0) for p in g[1]), reverse=True)

    # Within a unit, parameters of one optimizer group are contiguous (one segment per group).
    def by_group(p):
        return (group_of[p], order.get(p, 0))

    units = [ParamUnit(i, root, sorted(ps, key=by_group), world_size) for i, (root, ps) in enumerate(groups)]
    if persistent:
        unit = ParamUnit(len(units), module, sorted(persistent, key=by_group), world_size, persistent=True)
        for param in persistent:
            param.ds_persist = True
        units.append(unit)
    return units
