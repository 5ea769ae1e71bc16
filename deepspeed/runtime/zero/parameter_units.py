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
size); the unit's rank-major buffer is ``W`` rows of ``C = sum(s)`` columns, row
``r`` holding every parameter's shard ``r``. Row ``r`` is exactly rank ``r``'s
piece, so gather and reduce are single equal-chunk collectives.

States. A unit is SHARDED, GATHERING (its all-gather in flight) or GATHERED
(:class:`UnitState`); only a SHARDED unit launches a gather, only a GATHERED one
is released.

Lifetimes. ``UnitCoordinator`` keeps, per unit, the forward uses outstanding
(module pre/post-forward hooks: the unit root and every module owning parameters of
the unit, so calling a submodule directly works) and a *backward hold* (set by a
pre-backward hook on the outputs of those modules, on every backward visit, so a
second backward over a retained graph gathers again). A unit is released when it
has no forward use, no backward hold, and is not persistent. The stage's gradient
pipeline clears a unit's hold once all its trainable parameters delivered their
gradient in the running backward; the session epilogue clears whatever is left.
"""

import enum
import functools

import torch

from torch.autograd import Variable

from deepspeed.runtime import compiler
from deepspeed.runtime.backward import registry
from deepspeed.runtime.backward.ownership import tensors_in
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.profiling import ds_range
from deepspeed.runtime.zero.transport import DEFAULT_TRANSPORT, wait


class UnitState(enum.Enum):
    SHARDED = "sharded"  # only the shards exist; the parameters' ``.data`` are empty
    GATHERING = "gathering"  # an all-gather of the unit is in flight
    GATHERED = "gathered"  # the parameters hold their full values


class ParamUnit:
    """Parameters gathered and reduced together (see the module docstring).

    Column layout of a unit row: parameter ``i`` takes ``shards[i]`` columns from
    ``columns[i]``; ``chunk`` columns in all. ``fwd_refs`` counts forward uses outstanding,
    ``bwd_hold`` is set while a backward visit still needs the unit.
    """

    def __init__(self, index, root, params, world_size, persistent=False):
        self.index = index
        self.root = root
        self.params = params
        self.persistent = persistent
        self.world_size = world_size
        self.shards = [p.ds_shard_numel for p in params]
        self.columns = []
        column = 0
        for shard in self.shards:
            self.columns.append(column)
            column += shard
        self.chunk = column
        self.state = UnitState.SHARDED
        self.fwd_refs = 0
        self.bwd_hold = False
        self._gather = None  # (work, buffer) while GATHERING
        self._full = None  # the gathered storage, kept (resized to 0) across releases
        self._views = None


class UnitCoordinator:
    """Gathers, releases and prefetches units, driven by module hooks and the backward session.

    ``pipeline`` is the engine's gradient pipeline: a backward that reaches one of these
    modules joins it (so its epilogue releases what that backward gathered).
    ``send_chunk(unit)`` returns ``(row, ready)``: this rank's row of ``unit`` in the model dtype, on the
    device, once ``ready`` (a :class:`~deepspeed.runtime.zero.transfers.Transfer`) completed.
    """

    def __init__(self, module, units, send_chunk_fn, pipeline, group, device, transport=None):
        self.module = module
        self.units = units
        self._send_chunk = send_chunk_fn
        self.pipeline = pipeline
        self.group = group
        self.device = device
        self.transport = transport or DEFAULT_TRANSPORT
        self.world_size = units[0].world_size if units else 1
        self._handles = []
        self._trace = []  # unit order of the first forward, for prefetching
        self._tracing = True
        self._position = {}
        self._unsessioned_task = None  # a graph task with no session whose end releases its holds
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
            self._handles.append(module.register_forward_pre_hook(self._hook(self._pre_forward, units)))
            self._handles.append(module.register_forward_hook(self._hook(self._post_forward, units)))

    @staticmethod
    def _hook(method, units):

        def hook(*args):
            return method(units, *args)

        return compiler.disable(hook)

    def remove_hooks(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def reinstall_hooks(self):
        """Install the module hooks again (after torch.compile was loaded, so that they are marked for it)."""
        self.remove_hooks()
        self._install_hooks()

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
        with ds_range("DS::gather"):
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
            session.factor_for(self.pipeline)
        else:
            self._release_at_task_end()
        with ds_range("DS::gather"):
            for unit in units:
                unit.bwd_hold = True
                self.gather(unit)
                self._prefetch_after(unit, forward=False)
        return None

    def _release_at_task_end(self):
        # A backward no session covers (``registry.suspended()``: a monitor's Hessian-vector
        # products) still gathers what it visits; it releases at the end of its graph task.
        task = torch._C._current_graph_task_id()
        if task >= 0 and task != self._unsessioned_task:
            self._unsessioned_task = task
            Variable._execution_engine.queue_callback(self._end_unsessioned)

    def _end_unsessioned(self):
        self._unsessioned_task = None
        self.end_backward()

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
            if unit.state is UnitState.GATHERING and unit.fwd_refs <= 0:
                self._finish_gather(unit)
            self._maybe_release(unit)

    def release_all(self):
        """Drop every gathered copy, persistent ones too (their shards changed: the step updated them)."""
        for unit in self.units:
            unit.fwd_refs = 0
            unit.bwd_hold = False
            if unit.state is UnitState.GATHERING:
                self._finish_gather(unit)
            if unit.state is UnitState.GATHERED:
                self._release(unit)

    def _maybe_release(self, unit):
        if unit.state is UnitState.GATHERED and unit.fwd_refs <= 0 and not unit.bwd_hold and not unit.persistent:
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
        unit.state = UnitState.SHARDED

    # ---------------------------------------------------------------- gather
    def _launch_gather(self, unit):
        send, ready = self._send_chunk(unit)
        if self.world_size == 1:
            unit._gather = (ready, send)  # waiting on the copy orders the compute stream after it
        else:
            buffer = torch.empty(self.world_size * unit.chunk, dtype=send.dtype, device=self.device)
            with ready.ordered():  # the all-gather reads ``send`` after its copy; the compute stream does not wait
                unit._gather = (self.transport.all_gather(buffer, send, self.group), buffer)
        unit.state = UnitState.GATHERING
        for param in unit.params:
            param.ds_status = ZeroParamStatus.INFLIGHT

    def _finish_gather(self, unit):
        work, buffer = unit._gather
        unit._gather = None
        wait(work)
        rows = buffer.view(self.world_size, unit.chunk)
        full = unit._full
        if full is None:
            total = sum(self.world_size * s for s in unit.shards)
            full = unit._full = torch.empty(total, dtype=buffer.dtype, device=self.device)
            unit._views = []
            at = 0
            for param, s in zip(unit.params, unit.shards):
                padded = full.narrow(0, at, self.world_size * s)
                unit._views.append((padded, padded[:param.ds_numel].view(param.ds_shape)))
                at += self.world_size * s
        else:
            full.untyped_storage().resize_(full.numel() * full.element_size())
        with torch.no_grad():
            for param, column, s, (padded, view) in zip(unit.params, unit.columns, unit.shards, unit._views):
                padded.view(self.world_size, s).copy_(rows[:, column:column + s])
                param.data = view
                param.ds_status = ZeroParamStatus.AVAILABLE
        unit.state = UnitState.GATHERED

    def gather(self, unit):
        """Make ``unit``'s parameters whole (a collective, unless already gathered or in flight)."""
        if unit.state is UnitState.GATHERED:
            return
        if unit.state is UnitState.SHARDED:
            self._launch_gather(unit)
        self._finish_gather(unit)

    def _prefetch_after(self, unit, forward):
        position = self._position.get(unit.index)
        if position is None:
            return
        nxt = position + 1 if forward else position - 1
        if 0 <= nxt < len(self._trace):
            candidate = self._trace[nxt]
            if candidate.state is UnitState.SHARDED and not candidate.persistent:
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
