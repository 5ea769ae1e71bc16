# SPDX-License-Identifier: Apache-2.0
"""The parameter tier: ZeRO-3's 16-bit shards on disk (``offload_param.device: nvme``).

:class:`ParamShardSwap` keeps, per param group (and the frozen parameters), the rank's 16-bit shard partition in
``{nvme_path}/zero_stage_3/{dtype}params/rank{r}/``, paged by unit segment (a unit's piece of a group, cut into pages
of at most ``offload_param.buffer_size`` elements: no parameter has to fit one buffer). Its cache of pinned pages holds
``max(buffer_count pages, max_in_cpu elements)``; everything else is on disk.

Hot paths, while swapped:

* a unit's gather (:meth:`fetch_row`, from ``Stage3._send_chunk``): each page of the unit's row is read (unless
  cached: a read started ahead of it, or a page the step just wrote), copied to the device on the fetch's transfer
  stream, and kept from reuse until that copy completed; the coordinator names the next units of the forward or
  backward order as it goes (:meth:`read_ahead_units`) and their pages are read into idle slots meanwhile;
* the offloaded step writes each piece's 16-bit values into its pages (:meth:`open_target`/:meth:`close_target`,
  from ``StepPipeline.step_piece``) and they are written back behind it: the next forward's gathers find them
  cached or read them back;
* without optimizer offload (masters on the device) :meth:`write_from` casts a group's masters into its pages.

Outside them the tier is resident like the optimizer tier (:mod:`~deepspeed.runtime.swap_tensor.disk_tier`): the
stage's ``shards`` (and ``sources``, the host step's ``targets``, every parameter's ``ds_tensor`` views) are whole host
tensors for ``GatheredParameters``, accessors, checkpoints and the consolidated state dict; the next step (or
refresh) writes them out again and puts empty tensors in their place.
"""

import torch

from deepspeed.runtime.swap_tensor.disk_tier import release_host_cache, DiskTier
from deepspeed.runtime.swap_tensor.swap_folder import param_folder
from deepspeed.runtime.zero.offload.transfers import DONE, pinned

FIELD = "param"


class ParamShardSwap(DiskTier):
    """The 16-bit shards of ``stage`` (a ``Stage3``) on disk (see the module docstring)."""

    def __init__(self, stage, table, config, rank):
        super().__init__(config,
                         param_folder(config.nvme_path, stage.model_dtype, rank),
                         table, {FIELD: stage.model_dtype},
                         pin=True)
        self.stage = stage
        self.dtype = stage.model_dtype
        self.numel = list(table.group_numel)
        self._unit_pages = {}
        for unit in stage.units:
            pages = []
            for g, part_offset, _, length in stage.layout.segments[unit.index]:
                pages += [page for page, _, _, _ in table.covering(g, part_offset, length)]
            self._unit_pages[unit.index] = pages
        self._empty = torch.empty(0, dtype=self.dtype)

    # ------------------------------------------------------------- residency
    def _host_targets(self):
        host_step = self.stage.host_step
        return host_step.targets if host_step is not None and self.stage._host_shards else None

    def swap_out(self):
        """Write the host shards to disk and drop them (a no-op when swapped)."""
        if not self.resident:
            return
        stage, store = self.stage, self.store
        if stage.host_step is not None:
            stage.host_step.wait_readers(stage.fetch)
        elif stage.fetch is not None:
            stage.fetch.synchronize()
        try:
            for g, shard in enumerate(stage.shards):
                for page in self.table.group_pages[g]:
                    _, start, length = self.table.pages[page]
                    view = store.acquire(page, read=False, modify=True)
                    try:
                        view.fields[FIELD].copy_(shard.narrow(0, start, length))
                    finally:
                        store.release(page, dirty=True)
            store.flush()
        except Exception as error:
            raise self.failed(error, "writing the parameter shards") from error
        self._point_at(None)
        self.resident = False
        release_host_cache()

    def swap_in(self):
        """Read the shards into host tensors again and point ``ds_tensor`` at them (a no-op when resident)."""
        if self.resident:
            return
        stage, store = self.stage, self.store
        if stage.host_step is not None:
            stage.host_step.finish()
        order = [p for indexes in self.table.group_pages for p in indexes]
        self.plan(order)
        shards = []
        try:
            for g, numel in enumerate(self.numel):
                shard = pinned(torch.empty(numel, dtype=self.dtype), stage.config.param_pin_memory)
                for page in self.table.group_pages[g]:
                    _, start, length = self.table.pages[page]
                    view = self.acquire(page)
                    try:
                        shard.narrow(0, start, length).copy_(view.fields[FIELD])
                    finally:
                        store.release(page)
                shards.append(shard)
        except Exception as error:
            raise self.failed(error, "reading the parameter shards") from error
        self._point_at(shards)
        self.resident = True

    def _point_at(self, shards):
        """Make the stage's shards, sources, the host step's targets and every ``ds_tensor`` the host ``shards``, or
        empty placeholders (``None``: swapped)."""
        stage = self.stage
        layout = stage.layout
        num_groups = len(stage.masters)
        targets = self._host_targets()
        for g in range(len(self.numel)):
            shard = None if shards is None else shards[g]
            stage.shards[g] = shard
            stage.sources[g] = shard
            if targets is not None and g < num_groups:
                targets[g] = shard
        with torch.no_grad():
            for param in stage.module.parameters():
                slot = layout.slots.get(param)
                if slot is None:
                    continue
                param.ds_tensor = self._empty if shards is None else layout.shard_view(shards[slot.group], param)

    # -------------------------------------------------------------- gathers
    def fetch_row(self, unit, out):
        """``(row, ready)``: ``unit``'s row of this rank on the device (``out`` when given), page by page from the
        cache or the disk; ``ready`` is the last copy (the transfer stream completes them in order)."""
        stage = self.stage
        fetch = stage.fetch
        row = torch.empty(unit.chunk, dtype=self.dtype, device=stage.device) if out is None else out
        last = DONE
        store = self.store
        pages = self._unit_pages[unit.index]
        self.plan(pages)
        try:
            for g, part_offset, column, length in stage.layout.segments[unit.index]:
                for page, offset, start, n in self.table.covering(g, part_offset, length):
                    view = self.acquire(page)
                    try:
                        last = fetch.transfers.copy(row.narrow(0, column + start - part_offset, n),
                                                    view.fields[FIELD].narrow(0, offset, n))
                    finally:
                        store.release(page, busy=last if last is not DONE else None)
        except Exception as error:
            raise self.failed(error, f"reading the parameter shards of unit {unit.index}") from error
        return row, last

    def read_ahead_units(self, units):
        """Start reading the pages of ``units`` (the next ones the forward or backward gathers) into idle slots."""
        pages = []
        for unit in units:
            pages += self._unit_pages.get(unit.index, [])
        self.store.prefetch(pages[:max(0, self.store.slots - 1)])

    # ----------------------------------------------------------------- step
    def open_target(self, page, offset, length):
        """A writable view of elements ``[offset, offset + length)`` of ``page`` (the step's 16-bit target); read
        first only where the range does not cover the whole page."""
        whole = offset == 0 and length == self.table.pages[page][2]
        try:
            view = self.store.acquire(page, read=not whole, modify=True)
        except Exception as error:
            raise self.failed(error, "reading the parameter shards") from error
        return view.fields[FIELD].narrow(0, offset, length)

    def close_target(self, page):
        """The step wrote the page: write it back behind the step (it stays cached for the next gather)."""
        self.store.release(page, dirty=True)

    def finish_writes(self):
        try:
            self.store.flush()
        except Exception as error:
            raise self.failed(error, "writing the parameter shards") from error

    def write_from(self, g, source):
        """Cast ``source`` (group ``g``'s fp32 masters, on any device) into the group's pages and write them back."""
        store = self.store
        try:
            for page in self.table.group_pages[g]:
                _, start, length = self.table.pages[page]
                view = store.acquire(page, read=False, modify=True)
                try:
                    view.fields[FIELD].copy_(source.narrow(0, start, length))
                finally:
                    store.release(page, dirty=True)
        except Exception as error:
            raise self.failed(error, "writing the parameter shards") from error
