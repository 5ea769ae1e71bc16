# SPDX-License-Identifier: Apache-2.0
"""What both disk tiers share: a rank's swap folder, an aio engine, a :class:`PagedStore` and a read-ahead window.

A tier is *resident* or *swapped*. Resident, its tensors are whole host tensors and every reader and writer of the
runtime (accessors, checkpoints, a whole-partition step) works on them as with CPU offload; swapped, the tensors
live in the files and the hot paths (the offloaded step's pieces, ZeRO-3 gathers) move them page by page through
the cache. A tier swaps in when something outside the hot paths needs the tensors, and out again before the next
pipelined step: so those paths are exactly CPU offload's, and the hot paths give the same bits (the host op's
update is elementwise, and pages hold the same values).

Every I/O error reaches the caller as :class:`~deepspeed.ops.aio.backends.AsyncIOError` (the file, the offset, the
errno) with the tier's config key added; the engine turns it into an error on every rank (``comm/peer_failure``).
"""

import torch

from deepspeed.ops.aio.backends import AsyncIOError
from deepspeed.runtime.swap_tensor.paged_store import PagedStore
from deepspeed.runtime.swap_tensor.swap_folder import SwapFolder, check_nvme_path


def release_host_cache():
    """Return the page-locked blocks torch's host allocator keeps cached to the system.

    A tier swaps out host tensors that were page-locked (the masters and 16-bit shards the stage built, pinned for
    CPU offload, and whole tensors a swap-in made): freeing them returns their blocks to torch's caching host
    allocator, which keeps them resident and locked. Emptying it after a swap-out is what makes the swapped bytes
    leave host memory (measured on the 0.5e9-parameter benchmark: docs/offload.md, "What stays in host memory").
    Blocks in use, or read by a copy still in flight, are kept."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        empty()


class DiskTierError(RuntimeError):
    """A disk tier could not read or write its files (the message names the file, the errno and the config key)."""


class DiskTier:
    """A rank's folder, aio engine and paged store of ``fields`` over ``table`` (the pages of ``groups``, default all;
    cache buffers page-locked when ``pin``: those the device copies from) (see the module docstring)."""

    def __init__(self, config, folder_path, table, fields, groups=None, pin=False, file_stem="group{g}.{field}"):
        self.config = config
        self.table = table
        check_nvme_path(config.nvme_path, config.key)  # a missing mount point is not created: it names a device
        self.folder = SwapFolder(folder_path, config.key)
        self.io = None
        try:
            self.io = config.aio.open()
            self.folder.probe_direct(self.io)
            groups = range(len(table.group_pages)) if groups is None else groups
            files = {(g, name): self.folder.file(file_stem.format(g=g, field=name)) for g in groups for name in fields}
            self.store = PagedStore(table, fields, files, self.io, config.slots(table.page_numel), pin)
            self.folder.reserve({files[key]: nbytes for key, nbytes in self.store.file_bytes.items()})
        except BaseException:
            if self.io is not None:
                self.io.close()
            self.folder.close()
            raise
        self.resident = True
        self._sequence = []
        self._position = {}

    # ------------------------------------------------------------ read-ahead
    def plan(self, pages):
        """The order the next pass will acquire ``pages`` in (reads run ahead along it)."""
        self._sequence = list(pages)
        self._position = {}
        for i, page in enumerate(self._sequence):
            self._position.setdefault(page, i)

    def acquire(self, page, **kwargs):
        """``store.acquire(page, **kwargs)``, then :meth:`read_ahead` past it: the read-ahead starts once the page
        is pinned, when the slot of the page released before it is most likely free again."""
        view = self.store.acquire(page, **kwargs)
        self.read_ahead(page)
        return view

    def read_ahead(self, page):
        """Start reading the pages after ``page`` in the planned order, as far as idle slots allow."""
        at = self._position.get(page)
        if at is None:
            return
        window = max(1, self.store.slots - 2)
        self.store.prefetch(self._sequence[at + 1:at + 1 + window], keep=(page, ))

    # ---------------------------------------------------------------- errors
    def failed(self, error, doing):
        """A :class:`DiskTierError` for an aio error met while ``doing`` (what the tier was doing)."""
        if isinstance(error, AsyncIOError):
            return DiskTierError(f"NVMe offload ({self.config.key} = {self.config.nvme_path}): {doing} failed: "
                                 f"{error.strerror or error}")
        return error

    def close(self):
        """Complete what is in flight, remove the files (a cache, never a checkpoint), release the folder."""
        try:
            self.store.drop_cache()
        except Exception:
            pass
        try:
            self.io.close()
        finally:
            self.folder.close()


EMPTY_FP32 = torch.empty(0, dtype=torch.float32)
