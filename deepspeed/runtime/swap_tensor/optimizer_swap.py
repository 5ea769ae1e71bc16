# SPDX-License-Identifier: Apache-2.0
"""The optimizer tier: an offloaded step's fp32 masters and optimizer state on disk (``offload_optimizer.device:
nvme``).

:class:`OptimizerStateSwap` belongs to a :class:`~deepspeed.runtime.zero.offload.offload_step.HostStep`, on ZeRO 1,
2 and 3, whatever steps it. Per param group it keeps, per page, the ``fp32`` master and every per-element state
tensor of the optimizer (``fields``: ``exp_avg`` and ``exp_avg_sq`` for Adam, ``exp_avg`` for Lion, ``exp_avg_sq``
for ``DeepSpeedCPUAdagrad``..., found by ``paged_step.probe_state_fields``) in
``{nvme_path}/zero_stage_3/optimizer/rank{r}/``; the window gradient partitions and the 16-bit targets stay in host
memory, as with CPU offload. ``on_disk[g]``: the state fields group ``g`` has so far (none before its first step).

Two steps page it:

* the pipelined step (``step_pipeline.py``: ``DeepSpeedCPUAdam`` on the host Adam op) calls :meth:`step_range` for
  every page of every piece, in the pieces' order: the page is read (ahead: while the previous pages are stepped, the
  next ones are read into idle cache slots), stepped by the same host Adam op with the same scalars, and written back
  behind the step; its 16-bit values go to the piece's target as before. Before the first step the moments are not on
  disk: their fields are zero-filled, as the optimizer creates them (same bits). The pages are the pieces' (``table``);
* any other step (``paged_step.PagedStep``): the inner optimizer's own ``step()`` on each page in turn, the pages cut
  on ``paged_step.grid_table``.

The step count stays in the optimizer's state (``state["step"]``, counted once per step).

Outside the step (the tier's :class:`~deepspeed.runtime.swap_tensor.disk_tier.DiskTier` contract) the masters'
``.data`` is an empty tensor and the optimizer state holds only ``step``; :meth:`swap_in` makes them whole host
tensors again for whoever reads or writes them (accessors, ``state_dict``, checkpoints, a whole-partition step), and
the next pipelined step writes them out first (:meth:`swap_out`).
"""

import torch

from deepspeed.ops.adam import host_adam
from deepspeed.runtime.swap_tensor.disk_tier import release_host_cache, EMPTY_FP32, DiskTier
from deepspeed.runtime.swap_tensor.swap_folder import optimizer_folder

MOMENTS = ("exp_avg", "exp_avg_sq")
ADAM_FIELDS = {k: torch.float32 for k in MOMENTS}


class OptimizerStateSwap(DiskTier):
    """The fp32 masters and moments of ``host_step`` on disk (see the module docstring)."""

    def __init__(self, host_step, table, config, rank, fields=None):
        """``table``: the pages of the masters' groups (ZeRO-3 may pass the parameter tier's table, one group more);
        ``fields``: ``{name: dtype}`` of the optimizer's per-element state (default: Adam's moments)."""
        groups = range(len(host_step.masters))
        fields = dict(ADAM_FIELDS if fields is None else fields)
        if "fp32" in fields:
            raise ValueError("OptimizerStateSwap: 'fp32' names the masters' field, not an optimizer state")
        super().__init__(config,
                         optimizer_folder(config.nvme_path, rank),
                         table, {
                             "fp32": torch.float32,
                             **fields
                         },
                         groups=groups)
        self.keys = tuple(fields)
        self.host_step = host_step
        self.numel = [m.numel() for m in host_step.masters]
        if self.numel != table.group_numel[:len(self.numel)]:
            self.close()
            raise ValueError(f"OptimizerStateSwap: the page table covers {table.group_numel} elements per group, the "
                             f"masters hold {self.numel}")
        self.on_disk = [frozenset()] * len(self.numel)
        self.swap_out()

    # ------------------------------------------------------------- residency
    def _state(self, g):
        return self.host_step.optimizer.state.get(self.host_step.masters[g])

    def swap_out(self):
        """Write the masters and the per-element state to disk and drop their host tensors (a no-op when swapped)."""
        if not self.resident:
            return
        host_step, store = self.host_step, self.store
        present = []
        try:
            for g, master in enumerate(host_step.masters):
                state = self._state(g) or {}
                held = {
                    k
                    for k, v in state.items() if torch.is_tensor(v) and v.dim() == 1 and v.numel() == self.numel[g]
                }
                extra = held - set(self.keys)
                if extra:
                    raise ValueError(f"OptimizerStateSwap: the optimizer state of group {g} holds {sorted(extra)}, "
                                     f"which the optimizer tier does not page (it pages {list(self.keys)})")
                held &= set(self.keys)
                for page in self.table.group_pages[g]:
                    _, start, length = self.table.pages[page]
                    out = store.acquire(page, read=False, modify=True)
                    try:
                        out.fields["fp32"].copy_(master.data.narrow(0, start, length))
                        for k in self.keys:
                            if k in held:
                                out.fields[k].copy_(state[k].narrow(0, start, length))
                            else:
                                out.fields[k].zero_()
                    finally:
                        store.release(page, dirty=True)
                present.append(frozenset(held))
            store.flush()
        except Exception as error:
            raise self.failed(error, "writing the optimizer state") from error
        for g, master in enumerate(host_step.masters):
            self.on_disk[g] = present[g]
            master.data = EMPTY_FP32
            state = self._state(g)
            if state is not None:
                for k in present[g]:
                    state.pop(k, None)
        self.resident = False
        release_host_cache()

    def swap_in(self):
        """Read the masters (and the state, once it exists) into host tensors again (a no-op when resident)."""
        if self.resident:
            return
        host_step, store = self.host_step, self.store
        order = [p for indexes in self.table.group_pages[:len(self.numel)] for p in indexes]
        self.plan(order)
        values = []
        try:
            for g in range(len(self.numel)):
                # pageable: resident masters are read and written on the host only (the next step writes them out)
                master = torch.empty(self.numel[g], dtype=torch.float32)
                moments = {k: torch.empty(self.numel[g], dtype=self.store.fields[k]) for k in sorted(self.on_disk[g])}
                for page in self.table.group_pages[g]:
                    _, start, length = self.table.pages[page]
                    view = self.acquire(page)
                    try:
                        master.narrow(0, start, length).copy_(view.fields["fp32"])
                        for k, tensor in moments.items():
                            tensor.narrow(0, start, length).copy_(view.fields[k])
                    finally:
                        store.release(page)
                values.append((master, moments))
        except Exception as error:
            raise self.failed(error, "reading the optimizer state") from error
        for g, (master, moments) in enumerate(values):
            host_step.masters[g].data = master
            if moments:
                state = host_step.optimizer.state[host_step.masters[g]]
                state.update(moments)
        self.resident = True

    # ------------------------------------------------------------------ step
    def prepare(self):
        """Per group with a gradient: ``(None, grad, state, scalars)``, the step counted now (``StepPipeline``)."""
        host_step = self.host_step
        optimizer = host_step.optimizer
        prepared = {}
        for g, group, master, grad in host_step.stepped_groups():
            if grad.dtype != torch.float32 or grad.device.type != "cpu" or not grad.is_contiguous():
                raise ValueError("OptimizerStateSwap: the gradients must be contiguous float32 host tensors")
            state = optimizer._state_for(master, master, group)  # the step count, as the optimizer creates it
            for k in MOMENTS:
                if isinstance(state.get(k), torch.Tensor) and state[k].numel() == 0:
                    del state[k]  # made empty, shaped like the swapped-out master: the pages hold the moments
            state["step"] += 1
            prepared[g] = (None, grad, state, host_adam.step_scalars(group, float(state["step"])))
        return prepared

    def plan_pieces(self, pieces):
        """The pages of ``pieces`` in stepping order: reads run ahead along them."""
        self.plan([
            page for piece in pieces if not piece.on_device
            for page, _, _, _ in self.table.covering(piece.group, piece.start, piece.length)
        ])

    def step_range(self, entry, group, start, length, out, grad_scale, threads):
        """Step elements ``[start, start + length)`` of ``group`` (within one page): read the page, step it with the
        host op writing ``out`` (a 16-bit view of the range, or None), write it back behind."""
        host_step = self.host_step
        _, grad, state, scalars = entry
        ((page, offset, _, _), ) = self.table.covering(group, start, length)
        store = self.store
        try:
            view = self.acquire(page, modify=True)
        except Exception as error:
            raise self.failed(error, "reading the optimizer state") from error
        try:
            param = view.fields["fp32"].narrow(0, offset, length)
            moments = {k: view.fields[k].narrow(0, offset, length) for k in MOMENTS}
            if not self.on_disk[group]:
                for tensor in moments.values():
                    tensor.zero_()
            writes = out is not None and out.dtype != torch.float32
            host_adam.step_piece(host_adam.host_adam_op(), host_step.optimizer.param_groups[group], scalars, param,
                                 grad.narrow(0, start, length), moments, 0, length, out if writes else None,
                                 grad_scale, threads)
            if out is not None and not writes:  # an fp32 model: the target is a copy of the master
                out.copy_(param)
        finally:
            store.release(page, dirty=True)

    def finish_step(self, stepped):
        """After every piece of a pipelined step of the groups ``stepped``: their moments are on disk from now on; wait
        for the write-backs."""
        for g in stepped:
            self.on_disk[g] = frozenset(MOMENTS)
        try:
            self.store.flush()
        except Exception as error:
            raise self.failed(error, "writing the optimizer state") from error
