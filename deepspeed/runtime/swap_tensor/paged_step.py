# SPDX-License-Identifier: Apache-2.0
"""The offloaded step of any elementwise optimizer, range by range over the disk tiers.

The pipelined host step (``zero/offload/step_pipeline.py``) runs ``DeepSpeedCPUAdam`` on the host Adam op and pages the
optimizer tier piece by piece. Every other offloaded step (torch's Adam/AdamW through ``torch_adam``, Lion, Adagrad,
a client optimizer, an fp32 model, ``DS_OFFLOAD_OVERLAP=0``, a 16-bit gradient window) is a *whole-partition* step:
the inner optimizer's own ``step()`` over each param group's flat fp32 master. :class:`PagedStep` runs that step
over ranges of the partition instead, so that only a few ranges of the state are in host memory at a time:

* each range ``[start, start + length)`` of group ``g`` becomes a parameter of its own for one ``optimizer.step()``
  (:func:`step_range`): a ``Parameter`` over the range's master (a page of the optimizer tier, or a view of the host
  master), its gradient a view of the gradient partition, its state the range's per-element state tensors (views of
  the page, or of the host state) plus a copy of the group's other state entries (``step``); the other groups step
  nothing meanwhile. The state the optimizer creates on its first step (moments) is copied into the range's place;
* the 16-bit copy goes where the whole step puts it (``fp16_param_groups`` for an optimizer that writes it in its
  pass, a cast afterwards otherwise): the host step's target range, or, with ZeRO-3's shards on disk, a scratch
  range written into the parameter tier's pages;
* ranges are cut at multiples of :data:`ALIGN` elements from the group's start (:func:`grid_table`): torch's fused
  CPU Adam kernel computes whole units of 16 floats with vector instructions and a group's last partial unit with
  scalar ones, so a range of any length but the last would change a few elements' last bit.

Same bits as the whole step for an optimizer whose update is elementwise, which :func:`probe_state_fields` checks
when the engine is built: it steps a small tensor twice whole and twice in :data:`PROBE_PAGES` ranges (random
values; the same hyperparameters, model dtype and copy target as the real step) and requires the same bits. An
optimizer that fails (a trust ratio over the partition, a counter kept on the optimizer rather than in the state,
a step that raises) is refused: ``initialize`` raises :class:`NotPageableError` naming the keys to change.

Step hooks registered on the inner optimizer run once per step (around all ranges), as in the whole step.
"""

import contextlib
import copy
from collections import OrderedDict

import torch

from deepspeed.runtime.swap_tensor.paged_store import PageTable

ALIGN = 64
PROBE_PAGES = (ALIGN, ALIGN, 37)  # a group's last range is shorter than the others


class NotPageableError(NotImplementedError):
    """The optimizer's step cannot run range by range with the same result (raised at ``initialize``)."""


def grid_table(group_numel, page_numel):
    """Pages of at most ``page_numel`` elements (rounded up to a multiple of :data:`ALIGN`) tiling each group."""
    page = -(-max(1, int(page_numel)) // ALIGN) * ALIGN
    return PageTable([[(0, int(n))] if n else [] for n in group_numel], page)


def split_state(state, length):
    """``(per_element, rest)``: the entries of ``state`` that are flat tensors of ``length`` elements, and the
    others (the step count and other scalars)."""
    per_element, rest = {}, {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() == 1 and value.numel() == length:
            per_element[key] = value
        else:
            rest[key] = value
    return per_element, rest


def _copied(entries):
    return {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in entries.items()}


@contextlib.contextmanager
def step_hooks_once(optimizer, call=True):
    """Inside: the optimizer's own step hooks do not run at each ``step()``; with ``call`` its pre-hooks run once on
    entry and its post-hooks once on exit (as around one whole step)."""
    names = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
    saved = [optimizer.__dict__.get(name) for name in names]
    if call and saved[0]:
        for hook in list(saved[0].values()):
            hook(optimizer, (), {})
    for name, hooks in zip(names, saved):
        if hooks is not None:
            setattr(optimizer, name, OrderedDict())
    try:
        yield
    finally:
        for name, hooks in zip(names, saved):
            if hooks is not None:
                setattr(optimizer, name, hooks)
    if call and saved[1]:
        for hook in list(saved[1].values()):
            hook(optimizer, (), {})


def step_range(optimizer, g, param, grad, state, out=None, fused_copy=False):
    """One ``optimizer.step()`` of param group ``g`` over one range (see the module docstring): ``param`` (flat fp32,
    updated in place) with ``grad`` and ``state``; ``out`` receives the 16-bit copy when ``fused_copy`` (the
    optimizer takes ``fp16_param_groups``). Returns the range's state after the step."""
    groups = optimizer.param_groups
    saved = [group["params"] for group in groups]
    part = torch.nn.Parameter(param)
    part.grad = grad
    try:
        for h, group in enumerate(groups):
            group["params"] = [part] if h == g else []
        optimizer.state[part] = state
        if fused_copy:
            optimizer.step(fp16_param_groups=[[out] if h == g else [] for h in range(len(groups))])
        else:
            optimizer.step()
        return optimizer.state.pop(part)
    finally:
        for group, params in zip(groups, saved):
            group["params"] = params
        optimizer.state.pop(part, None)


def step_page(optimizer, g, param, grad, fields, rest, out, fused_copy):
    """One range's step, as both the real step and the probe take it: the range's per-element state views
    ``fields`` and a copy of the group's other entries ``rest`` as its state; ``out`` receives the 16-bit copy.
    A per-element value the optimizer replaced rather than updated in place is copied back into ``fields``.
    Returns ``(created, after)``: the per-element state the optimizer made on this range (its first step), and the
    other entries after the step."""
    length = param.numel()
    page_state = _copied(rest)
    page_state.update(fields)
    new = step_range(optimizer, g, param, grad, page_state, out, fused_copy)
    if not fused_copy:
        out.copy_(param)
    per_element, after = split_state(new, length)
    created = {}
    for key, value in per_element.items():
        if key not in fields:
            created[key] = value
        elif value.data_ptr() != fields[key].data_ptr():
            fields[key].copy_(value)
    return created, after


def _probe_run(optimizer, g, init, grads, pages, out_dtype, fused_copy):
    """Step ``init`` with each of ``grads`` over the ranges ``pages``; the parameter, its copy and the state."""
    param = init.clone()
    out = torch.zeros(param.numel(), dtype=out_dtype)
    fields, rest = {}, {}
    for grad in grads:
        created, after = {}, {}
        start = 0
        for length in pages:
            new, after = step_page(optimizer, g, param.narrow(0, start, length), grad.narrow(0, start, length),
                                   {k: v.narrow(0, start, length) for k, v in fields.items()}, rest,
                                   out.narrow(0, start, length), fused_copy)
            for key, value in new.items():
                created.setdefault(key, torch.zeros(param.numel(), dtype=value.dtype)).narrow(0, start,
                                                                                              length).copy_(value)
            start += length
        fields.update(created)
        rest = after
    return param, out, fields, rest


def _same(a, b):
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    return a == b


def probe_state_fields(optimizer, model_dtype, fused_copy, key="zero_optimization.offload_optimizer.device"):
    """``{name: dtype}`` of the per-element state ``optimizer`` keeps (what a disk tier must page), after checking
    that its step gives the same bits range by range as on the whole tensor (module docstring); NotPageableError
    otherwise, naming ``key`` and the optimizer keys to change. ``fused_copy``: the step takes ``fp16_param_groups``
    (its 16-bit copy, of ``model_dtype``, is compared too)."""
    name = type(optimizer).__name__
    fields = {}
    numel = sum(PROBE_PAGES)
    gen = torch.Generator().manual_seed(20261207)
    with step_hooks_once(optimizer, call=False), torch.no_grad():
        for g, group in enumerate(optimizer.param_groups):
            if not group["params"]:
                continue
            init = torch.randn(numel, generator=gen)
            grads = [torch.randn(numel, generator=gen) for _ in range(2)]
            try:
                whole = _probe_run(optimizer, g, init, grads, (numel, ), model_dtype, fused_copy)
                paged = _probe_run(optimizer, g, init, grads, PROBE_PAGES, model_dtype, fused_copy)
            except Exception as error:
                raise NotPageableError(
                    f"{key} 'nvme' steps the optimizer state a page at a time (zero_optimization.sub_group_size "
                    f"elements), and the optimizer {name} could not step a part of a partition: "
                    f"{type(error).__name__}: {error}. Use {key} 'cpu', or an optimizer whose update is elementwise "
                    f"(Adam, AdamW, Lion, Adagrad, SGD; docs/offload.md)") from error
            differs = [
                what for what, a, b in (("parameter", whole[0], paged[0]), ("16-bit copy", whole[1], paged[1]))
                if not _same(a, b)
            ]
            differs += [
                f"state '{k}'" for k in sorted(set(whole[2]) | set(paged[2]))
                if not _same(whole[2].get(k), paged[2].get(k))
            ]
            differs += [
                f"state '{k}'" for k in sorted(set(whole[3]) | set(paged[3]))
                if not _same(whole[3].get(k), paged[3].get(k))
            ]
            if differs:
                fused = ""
                if group.get("fused"):
                    fused = " (param group key 'fused': torch's fused kernel rounds a range's tail differently)"
                raise NotPageableError(
                    f"{key} 'nvme' steps the optimizer state a page at a time (zero_optimization.sub_group_size "
                    f"elements), and the optimizer {name}'s update of param group {g} is not elementwise{fused}: "
                    f"stepped in parts, its {', '.join(differs)} differ from one step of the whole partition. Use "
                    f"{key} 'cpu', or an optimizer whose update is elementwise (Adam, AdamW, Lion, Adagrad, SGD; "
                    f"docs/offload.md)")
            for key_name, value in whole[2].items():
                if fields.setdefault(key_name, value.dtype) != value.dtype:
                    raise NotPageableError(f"{key} 'nvme': the optimizer {name} keeps state '{key_name}' in "
                                           f"{fields[key_name]} and {value.dtype} in different param groups")
    return fields


class PagedStep:
    """The whole-partition step of ``host_step`` (a ``HostStep``), range by range (see the module docstring).

    The ranges are the optimizer tier's pages (``host_step.swap``, built on :func:`grid_table`) when the masters are
    on disk; else (ZeRO-3's shards on disk, the masters in host memory) ``grid``'s pages."""

    def __init__(self, host_step, grid=None):
        self.host_step = host_step
        self.grid = grid

    @torch.no_grad()
    def run(self, optimizer):
        host_step = self.host_step
        swap = host_step.swap
        shards = host_step.shard_tier
        if shards is not None and shards.resident:
            shards = None
        if swap is not None:
            swap.swap_out()  # something made the state resident since the last step
            table = swap.table
        else:
            table = self.grid
        stepped = [g for g, _, _, _ in host_step.stepped_groups()]
        if swap is not None:
            swap.plan([p for g in stepped for p in table.group_pages[g]])
        fused_copy = host_step.writes_16bit
        with step_hooks_once(optimizer):
            for g in stepped:
                self._step_group(optimizer, g, table, swap, shards, fused_copy)
        if swap is not None:
            swap.finish_step(())
        if shards is not None:
            shards.finish_writes()

    def _step_group(self, optimizer, g, table, swap, shards, fused_copy):
        host_step = self.host_step
        master = host_step.masters[g]
        grad = master.grad
        numel = host_step.group_numel[g]
        state = optimizer.state.setdefault(master, {})
        if swap is not None:
            held, rest = {}, dict(state)  # the per-element state is in the pages
        else:
            held, rest = split_state(state, numel)
        target = host_step.targets[g]
        scratch = None
        if target is None:
            scratch = torch.empty(table.largest, dtype=host_step.model_dtype)
        created = {}
        after = rest
        for page in table.group_pages[g]:
            _, start, length = table.pages[page]
            view = None
            if swap is not None:
                try:
                    view = swap.acquire(page, modify=True)
                except Exception as error:
                    raise swap.failed(error, "reading the optimizer state") from error
                param = view.fields["fp32"]
                fields = {k: view.fields[k] for k in swap.on_disk[g]}
            else:
                param = master.data.narrow(0, start, length)
                fields = {k: v.narrow(0, start, length) for k, v in held.items()}
            try:
                out = target.narrow(0, start, length) if target is not None else scratch.narrow(0, 0, length)
                new, after = step_page(optimizer, g, param, grad.narrow(0, start, length), fields, rest, out,
                                       fused_copy)
                for key, value in new.items():
                    if view is not None:
                        if key not in view.fields:
                            raise RuntimeError(f"NVMe offload: the optimizer created state '{key}', which the "
                                               f"optimizer tier does not hold (it holds {sorted(swap.keys)})")
                        view.fields[key].copy_(value)
                        created[key] = True
                    else:
                        created.setdefault(key, torch.zeros(numel, dtype=value.dtype)).narrow(0, start,
                                                                                              length).copy_(value)
                if target is None:
                    self._write_shards(shards, g, start, length, out)
            finally:
                if view is not None:
                    swap.store.release(page, dirty=True)
        state = optimizer.state.setdefault(master, {})
        state.clear()
        state.update(after)
        if swap is not None:
            swap.on_disk[g] = swap.on_disk[g] | set(created)
        else:
            state.update(held)
            state.update(created)

    @staticmethod
    def _write_shards(shards, g, start, length, values):
        for page, offset, at, n in shards.table.covering(g, start, length):
            view = shards.open_target(page, offset, n)
            try:
                view.copy_(values.narrow(0, at - start, n))
            finally:
                shards.close_target(page)
