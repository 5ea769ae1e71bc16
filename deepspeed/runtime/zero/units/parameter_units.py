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

Leaf modules (``deepspeed.utils.set_z3_leaf_modules``: a mixture-of-experts block). The
whole subtree of a leaf is one unit rooted at the leaf (one per group when it holds experts
partitioned over a group of their own), whatever its size, small
parameters included (a parameter also registered outside the subtree stays in the root
unit). Only the leaf gets hooks, none of the modules inside it: the unit is gathered at
the leaf's forward, whichever experts its router picks, so every rank issues the same
gathers. Its gradient bucket is *held* (``GradPipeline.hold``): it completes when the
gradients of the leaf's inputs are complete, that is once the leaf's own backward is
over, on every rank at the same point whichever experts a rank used (or at the end of
the backward when no input needs a gradient); the unit is then released.

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
from deepspeed.runtime.zero.parameter_offload import ensure_zero_ordered_dict, restore_parameters_dict
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, init_external_params
from deepspeed.runtime.zero.gradients.profiling import ds_range
from deepspeed.runtime.zero.gradients.transport import wait
from deepspeed.runtime.zero.units.unit_fetch import UnitFetchPlan
from deepspeed.utils.z3_leaf_module import z3_leaf_module

# Units past the prefetched one whose shards a read-ahead callback is given (NVMe parameter offload reads them).
READ_AHEAD_UNITS = 2


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

    def __init__(self, index, root, params, world_size, persistent=False, spec=None):
        self.index = index
        self.root = root
        self.params = params
        self.persistent = persistent
        self.world_size = world_size
        # the ReductionSpec of an expert unit (partitioned and gathered over its expert-data-parallel group, of
        # ``world_size`` ranks); None: the stage's group
        self.spec = spec
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
        self.leaf = None  # the leaf module whose whole subtree this unit is, if it is one
        self._gather = None  # (work, wire buffer, keep a secondary shard) while GATHERING
        self._full = None  # the gathered storage, kept (resized to 0) across releases
        self._views = None


class UnitCoordinator:
    """Gathers, releases and prefetches units, driven by module hooks and the backward session.

    ``pipeline`` is the engine's gradient pipeline: a backward that reaches one of these
    modules joins it (so its epilogue releases what that backward gathered).
    ``send_chunk(unit, out)`` returns ``(row, ready)``: this rank's row of ``unit`` in the model dtype, on the
    device (written into ``out`` when given, a device tensor of ``unit.chunk`` elements), once ``ready`` (a
    :class:`~deepspeed.runtime.zero.offload.transfers.Transfer`) completed.
    """

    def __init__(self,
                 module,
                 units,
                 send_chunk_fn,
                 pipeline,
                 group,
                 device,
                 fetch=None,
                 expert_fetch=None,
                 read_ahead=None):
        self.module = module
        self._read_ahead = read_ahead  # called with the next units along the trace (NVMe reads start early)
        self.units = units
        self._send_chunk = send_chunk_fn
        self.pipeline = pipeline
        self.group = group
        self.device = device
        self.world_size = next((u.world_size for u in units if u.spec is None), 1)  # the stage's group's
        # the wire and the group of each gather, per phase (ZeRO++: qwZ, hpZ's secondary shard)
        self.fetch = fetch if fetch is not None else UnitFetchPlan(group, self.world_size)
        # expert units gather over their expert-data-parallel group: ``expert_fetch`` (group name -> plan, ZeRO++'s
        # wire and node axis over that group), rows as they are where it names none
        self._expert_fetch = dict(expert_fetch or {})
        for unit in units:
            if unit.spec is not None and unit.spec.name not in self._expert_fetch:
                self._expert_fetch[unit.spec.name] = UnitFetchPlan(unit.spec.group, unit.world_size)
        self._handles = []
        self._trace = []  # unit order of the first forward, for prefetching
        self._tracing = True
        self._position = {}
        self._frontier = -1  # the furthest trace position the running forward pass has used
        self._unsessioned_task = None  # a graph task with no session whose end releases its holds
        self._empties = {}
        self._unit_of_param = {p: u for u in units for p in u.params}
        # Hooked module -> the units its hooks gather (one list object, shared by its pre-forward, post-forward and
        # pre-backward hooks, so a unit registered while the module runs is covered from then on).
        self._module_units = {}
        self._forward_stack = []  # the hooked modules whose forward is running, innermost last
        for unit in units:
            if unit.leaf is not None:
                pipeline.hold(unit.index)
        self._install_hooks()

    # ----------------------------------------------------------------- hooks
    def _install_hooks(self):
        unit_of_param = self._unit_of_param
        leaf_units = {}  # leaf -> its units (one, or one per group when experts of their own group are inside)
        for unit in self.units:
            if unit.leaf is not None:
                leaf_units.setdefault(unit.leaf, []).append(unit)
        inside_leaf = {sub for leaf in leaf_units for sub in leaf.modules() if sub is not leaf}
        self._module_units = {}
        for module in self.module.modules():
            init_external_params(module)
            ensure_zero_ordered_dict(module, self)
        for module in self.module.modules():
            if module in inside_leaf:
                continue  # a leaf's subtree runs inside the leaf's forward, which gathered it whole
            units = []
            for unit in self.units:
                if unit.root is module and unit not in units:
                    units.append(unit)
            subtree = list(module.modules()) if module in leaf_units else [module]
            own = [p for sub in subtree for p in sub.parameters(recurse=False)]
            own += [p for sub in subtree for p in sub._external_params.values()]
            for param in own:
                unit = unit_of_param.get(param)
                if unit is not None and unit not in units:
                    units.append(unit)
            units = [u for u in units if not u.persistent]
            if not units and module is not self.module:  # the root is always hooked: it opens the forward
                continue
            self._module_units[module] = units
            self._handles.append(module.register_forward_pre_hook(self._hook(self._pre_forward, units)))
            self._handles.append(module.register_forward_hook(self._hook(self._post_forward, units)))
            if module in leaf_units:
                self._handles.append(
                    module.register_forward_pre_hook(self._hook(self._leaf_inputs, leaf_units[module]),
                                                     with_kwargs=True))

    @staticmethod
    def _hook(method, units):

        def hook(*args):
            return method(units, *args)

        return compiler.disable(hook)

    def remove_hooks(self):
        """Remove the module hooks; the modules' parameter dicts are plain dicts again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in self.module.modules():
            restore_parameters_dict(module)

    @property
    def hook_handles(self):
        """The module hooks' handles (upstream's ``forward_hooks``)."""
        return self._handles

    @hook_handles.setter
    def hook_handles(self, handles):
        self._handles = list(handles)

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
        if module is self.module:
            # a forward of the whole model begins: a stack left by a forward that raised is dropped, and modules
            # attached since the last forward get the gathering parameter dict too (upstream's prologue)
            self._forward_stack.clear()
            self._regather_persistent()
            for sub in module.modules():
                ensure_zero_ordered_dict(sub, self)
        if not self._forward_stack:
            self._frontier = -1  # an outermost module's forward: a new pass along the trace
        self._forward_stack.append(module)
        with ds_range("DS::gather"):
            for unit in units:
                self._use_in_forward(unit)

    def _use_in_forward(self, unit):
        """A forward reference on ``unit``, which is gathered (traced on the first forward, else prefetched after)."""
        unit.fwd_refs += 1
        self.gather(unit)
        if self._tracing and unit.index not in self._position:
            self._position[unit.index] = len(self._trace)
            self._trace.append(unit)
        elif not self._tracing:
            # Prefetch only from the frontier of this pass. A unit used again behind it (a block's shared expert
            # running after its routed experts, the lm_head after the model) would fetch the next unit, which this
            # pass has already used and released: a gather nobody waits for, held until the backward needs it.
            position = self._position.get(unit.index)
            if position is not None and position >= self._frontier:
                self._frontier = position
                self._prefetch_after(unit, forward=True)

    def gather_on_access(self, param):
        """``param`` (released) was read from its module's parameter dict (``ZeROOrderedDict``).

        In a forward it is an external parameter of the innermost hooked module running: its unit joins that
        module's units (gathered by its hooks from now on, held for its backward) and is gathered now, as
        upstream registers and gathers it. In a recompute inside the backward it is gathered (the backward's
        epilogue releases it). Outside a forward nothing is gathered: the parameter reads as released."""
        unit = self._unit_of_param.get(param)
        if unit is None or unit.persistent:
            return
        if torch._C._current_graph_task_id() >= 0:
            self.gather(unit)
            return
        if not self._forward_stack:
            return
        self._register_external(self._forward_stack[-1], param, unit)

    def _register_external(self, module, param, unit):
        module._external_params[id(param)] = param
        units = self._module_units[module]
        if unit not in units:
            units.append(unit)
            self._use_in_forward(unit)  # the module's post-forward hook drops this reference
        else:
            self.gather(unit)

    def _leaf_inputs(self, units, module, args, kwargs):
        # The leaf's backward is over once the gradient of every input that needs one is complete: a
        # pre-hook on the input's grad_fn (the node that takes that gradient) fires then, after every
        # module inside the leaf ran its backward, at the same point on every rank. The held bucket
        # completes there (``GradPipeline.release_hold``), so the unit is reduced and released.
        #
        # Only inputs computed by a node count. An autograd leaf input (a tensor created with
        # requires_grad=True) has no node after the leaf's backward: its gradient goes to an
        # AccumulateGrad node, which autograd may run before the leaf's parameters' own AccumulateGrad
        # nodes, so a hook there could release the unit while a parameter gradient is still on its
        # way (a zero-size parameter in its AccumulateGrad). A producer node runs only once every
        # gradient its consumers computed is delivered; when no input has one, the session epilogue
        # completes the unit, at one point on every rank as well.
        if not torch.is_grad_enabled():
            return None
        inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad and t.grad_fn is not None]
        if not inputs:
            return None  # nothing marks the end of its backward: the epilogue completes the unit
        remaining = {}  # graph task -> inputs whose gradient is not complete yet
        pipeline, indices, count = self.pipeline, [unit.index for unit in units], len(inputs)

        def input_done(*_):
            task = torch._C._current_graph_task_id()
            left = remaining.get(task, count) - 1
            remaining[task] = left
            if left == 0:
                for index in indices:
                    pipeline.release_hold(index)
            return None

        for tensor in inputs:
            tensor.grad_fn.register_prehook(input_done)
        return None

    def _post_forward(self, units, module, inputs, output):
        outputs = list(tensors_in(output))  # walked once, for both uses below
        if torch._C._current_graph_task_id() < 0:
            if self._forward_stack and self._forward_stack[-1] is module:
                self._forward_stack.pop()
                self._hand_returned_params(module, outputs)
            for unit in units:
                unit.fwd_refs -= 1
        if torch.is_grad_enabled():
            tensors = [t for t in outputs if t.requires_grad]
            if tensors:
                hook = functools.partial(self._pre_backward, units)
                for t in tensors:
                    t.register_hook(hook)
        for unit in units:
            self._maybe_release(unit)

    def _hand_returned_params(self, module, outputs):
        """A parameter ``module`` returns (among the tensors ``outputs``) is used by its caller: it becomes an external
        parameter of the innermost hooked module still running, unless one of those already has it (upstream's
        rule), and stops being one of ``module``'s own externals."""
        if not self._forward_stack:
            return
        for tensor in outputs:
            param = tensor if hasattr(tensor, "ds_id") else getattr(tensor, "ds_param_alias", None)
            unit = self._unit_of_param.get(param)
            if unit is None or unit.persistent:
                continue
            if any(id(param) in m._external_params for m in self._forward_stack):
                continue
            self._register_external(self._forward_stack[-1], param, unit)
            module._external_params.pop(id(param), None)

    def _pre_backward(self, units, grad):
        self._regather_persistent()  # released by empty_partition_cache after the forward that built this graph
        session = registry.session_for_current_task()
        if session is not None:
            session.factor_for(self.pipeline)
        else:
            self._release_at_task_end()
        with ds_range("DS::gather"):
            for unit in units:
                unit.bwd_hold = True
                self.gather(unit, backward=True)
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

    def forward_order(self):
        """The units in the order the first forward gathered them (empty before it ran)."""
        return list(self._trace)

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

    def hold_all(self):
        """Gather every unit and keep it until :meth:`drop_all_holds` (a forward reference on each)."""
        for unit in self.units:
            unit.fwd_refs += 1
            self.gather(unit)

    def drop_all_holds(self):
        """Undo :meth:`hold_all`: release the units nobody else needs."""
        for unit in self.units:
            unit.fwd_refs -= 1
            self._maybe_release(unit)

    def release_all(self):
        """Drop every gathered copy, persistent ones too (their shards changed: the step updated them), and every
        hpZ secondary shard."""
        self.invalidate_secondary()
        for unit in self.units:
            unit.fwd_refs = 0
            unit.bwd_hold = False
            if unit.state is UnitState.GATHERING:
                self._finish_gather(unit)
            if unit.state is UnitState.GATHERED:
                self._release(unit)

    def invalidate_secondary(self):
        """The 16-bit shards may have changed: drop every hpZ secondary shard (dense and expert units')."""
        self.fetch.invalidate()
        for plan in self._expert_fetch.values():
            plan.invalidate()

    def release_unused(self, persistent=False):
        """Release every unit nothing holds (no forward reference, no backward hold; persistent ones too with
        ``persistent``: they are gathered again when the next forward or backward begins); a gather in flight is
        completed first, so its collective is matched on every rank."""
        for unit in self.units:
            if unit.state is UnitState.GATHERING and (persistent or not unit.persistent):
                self._finish_gather(unit)
            if persistent and unit.persistent and unit.state is UnitState.GATHERED:
                self._release(unit)
                self._persistent_released = True
            self._maybe_release(unit)

    _persistent_released = False

    def _regather_persistent(self):
        """Gather the persistent units again after :meth:`release_unused` released them."""
        if self._persistent_released:
            self._persistent_released = False
            for unit in self.units:
                if unit.persistent:
                    self.gather(unit)

    def _maybe_release(self, unit):
        if unit.state is UnitState.GATHERED and unit.fwd_refs <= 0 and not unit.bwd_hold and not unit.persistent:
            self._release(unit)

    def _release(self, unit):
        empty = self._empty(unit)
        for param in unit.params:
            param.data = empty
            param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        # Free the memory in place: autograd may hold views of these parameters (a linear
        # saves weight.t()); they keep the storage object, not its memory, and see the
        # values again once the next gather refills the same storage.
        unit._full.untyped_storage().resize_(0)
        unit.state = UnitState.SHARDED

    def _empty(self, unit):
        """One shared zero-element tensor per dtype: what a released parameter's ``.data`` is."""
        dtype = unit.params[0].dtype if unit.params else torch.float32
        empty = self._empties.get(dtype)
        if empty is None:
            empty = self._empties[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return empty

    # ---------------------------------------------------------------- gather
    def _storage(self, unit, dtype):
        """The unit's gathered storage, allocated once and refilled in place: ``(full, views)``.

        ``full`` holds every parameter padded to ``W * shard``, one after another; ``views`` are
        ``(padded, shaped)`` per parameter.
        """
        full = unit._full
        if full is None:
            world = unit.world_size
            total = sum(world * s for s in unit.shards)
            full = unit._full = torch.empty(total, dtype=dtype, device=self.device)
            unit._views = []
            at = 0
            for param, s in zip(unit.params, unit.shards):
                padded = full.narrow(0, at, world * s)
                unit._views.append((padded.view(world, s), padded[:param.ds_numel].view(param.ds_shape)))
                at += world * s
        elif full.untyped_storage().size() == 0:
            full.untyped_storage().resize_(full.numel() * full.element_size())
        return full, unit._views

    def _fetch_of(self, unit):
        return self.fetch if unit.spec is None else self._expert_fetch[unit.spec.name]

    def _launch_gather(self, unit, backward=False):
        fetch = self._fetch_of(unit)
        if unit.world_size == 1:
            # On a world of one the unit's row is the whole unit, laid out as the gathered storage:
            # this rank's shards are cast (or uploaded) straight into it, no collective and no copy-out.
            full, _ = self._storage(unit, self._model_dtype(unit))
            _, ready = self._send_chunk(unit, full)
            unit._gather = (ready, None, False)  # waiting on the copy orders the compute stream after it
        elif not fetch.needs_row(backward, unit.index):  # hpZ: the node group's secondary shards serve
            unit._gather = fetch.launch(None, backward, unit.index)
        else:
            send, ready = self._send_chunk(unit, None)
            with ready.ordered():  # the all-gather reads ``send`` after its copy; the compute stream does not wait
                unit._gather = fetch.launch(send, backward, unit.index, keep=not unit.persistent)
        unit.state = UnitState.GATHERING
        for param in unit.params:
            param.ds_status = ZeroParamStatus.INFLIGHT

    @staticmethod
    def _model_dtype(unit):
        return unit.params[0].dtype if unit.params else torch.float32

    def _finish_gather(self, unit):
        work, buffer, keep = unit._gather
        unit._gather = None
        wait(work)
        dtype = self._model_dtype(unit)
        full, views = self._storage(unit, dtype)
        if buffer is not None:  # rank-major rows -> every parameter's padded block, in one copy
            rows = self._fetch_of(unit).finish(buffer, unit.chunk, dtype, keep, unit.index)
            torch.split_with_sizes_copy(rows.view(unit.world_size, unit.chunk),
                                        unit.shards,
                                        dim=1,
                                        out=[padded for padded, _ in views])
        for param, (_, shaped) in zip(unit.params, views):
            param.data = shaped
            param.ds_status = ZeroParamStatus.AVAILABLE
        unit.state = UnitState.GATHERED

    def gather(self, unit, backward=False):
        """Make ``unit``'s parameters whole (a collective, unless already gathered or in flight); ``backward``: for
        a backward visit (hpZ gathers it inside the node group when it can)."""
        if unit.state is UnitState.GATHERED:
            return
        if unit.state is UnitState.SHARDED:
            self._launch_gather(unit, backward)
        self._finish_gather(unit)

    def _prefetch_after(self, unit, forward):
        position = self._position.get(unit.index)
        if position is None:
            return
        direction = 1 if forward else -1
        nxt = position + direction
        if 0 <= nxt < len(self._trace):
            candidate = self._trace[nxt]
            if candidate.state is UnitState.SHARDED and not candidate.persistent:
                self._launch_gather(candidate, not forward)
        if self._read_ahead is not None:
            ahead = [
                self._trace[i] for i in range(nxt + direction, nxt + direction * (1 + READ_AHEAD_UNITS), direction)
                if 0 <= i < len(self._trace)
            ]
            if ahead:
                self._read_ahead(ahead)


def _leaf_params(module, wanted):
    """``(leaves, leaf_of)``: the outermost leaf modules, and param -> the leaf whose unit takes it.

    Every parameter of a leaf's subtree is marked ``ds_z3_leaf_module``; one also registered
    outside that subtree (tied to a module elsewhere) is left out of ``leaf_of``.
    """
    leaves = []
    inside = set()
    for sub in module.modules():
        if sub not in inside and z3_leaf_module(sub):
            leaves.append(sub)
            inside.update(sub.modules())
    leaf_of = {}
    for leaf in leaves:
        for param in leaf.parameters():
            param.ds_z3_leaf_module = leaf
            if param in wanted:
                leaf_of.setdefault(param, leaf)
    subtree = {leaf: set(leaf.modules()) for leaf in leaves}
    for sub in module.modules():
        for param in sub.parameters(recurse=False):
            leaf = leaf_of.get(param)
            if leaf is not None and sub not in subtree[leaf]:
                del leaf_of[param]
    return leaves, leaf_of


def build_units(module, params, unit_numel, persistence_threshold, world_size, group_of, expert_spec_of=None):
    """Choose the units of ``module`` for the partitioned ``params`` (see the module docstring).

    ``expert_spec_of(param)``: the ReductionSpec of an expert parameter partitioned over its own
    (expert-data-parallel) group, else None. A unit holds parameters of one such group only: a group of
    parameters chosen together is split into one unit per group (dense first, then experts by group name),
    all with the same root, so the same hooks gather them.
    """
    spec_of = expert_spec_of or (lambda p: None)
    wanted = set(params)
    leaves, leaf_of = _leaf_params(module, wanted)
    leaf_roots = set(leaves)
    registered = {}
    for sub in module.modules():
        for param in sub.parameters(recurse=False):
            registered[param] = registered.get(param, 0) + 1
    persistent = [p for p in params if p.ds_numel <= persistence_threshold and p not in leaf_of]
    taken = set(persistent)
    shared = [p for p in params if registered.get(p, 0) > 1 and p not in taken and p not in leaf_of]
    taken.update(shared)
    groups = []  # (root module, params, whether it is a leaf's subtree)
    seen = set()

    def visit(sub):
        if sub in seen:
            return []
        seen.add(sub)
        if sub in leaf_roots:  # the whole subtree, whatever its size; nothing inside roots a unit
            seen.update(sub.modules())
            mine = [p for p in sub.parameters() if leaf_of.get(p) is sub and p not in taken]
            taken.update(mine)
            if mine:
                groups.append((sub, mine, True))
            return []
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
            groups.append((sub, pending, False))
            return []
        return pending

    rest = visit(module) + shared
    if rest:
        groups.append((module, rest, False))
    order = {p: i for i, p in enumerate(module.parameters())}
    # Fixed unit order, the same on every rank: reverse registration (about backward order).
    groups.sort(key=lambda g: min(order.get(p, 0) for p in g[1]), reverse=True)

    # Within a unit, parameters of one optimizer group are contiguous (one segment per group).
    def by_group(p):
        return (group_of[p], order.get(p, 0))

    def by_spec(ps):
        """``[(spec, params)]``: the dense parameters, then each expert group's (by name, the same on every rank)."""
        split = {}
        for p in ps:
            spec = spec_of(p)
            split.setdefault(None if spec is None else spec.name, (spec, []))[1].append(p)
        return [split[name] for name in sorted(split, key=lambda n: (n is not None, n or ""))]

    units = []
    for root, ps, is_leaf in groups:
        for spec, mine in by_spec(ps):  # a leaf's units all gather at its forward and complete with its backward
            unit = ParamUnit(len(units),
                             root,
                             sorted(mine, key=by_group),
                             world_size if spec is None else spec.world_size,
                             spec=spec)
            unit.leaf = root if is_leaf else None
            units.append(unit)
    for spec, mine in by_spec(persistent):
        unit = ParamUnit(len(units),
                         module,
                         sorted(mine, key=by_group),
                         world_size if spec is None else spec.world_size,
                         persistent=True,
                         spec=spec)
        for param in mine:
            param.ds_persist = True
        units.append(unit)
    return units
