# SPDX-License-Identifier: Apache-2.0
"""Flat tensors kept on disk page by page, and a bounded cache of aligned host buffers in front of them.

A :class:`PageTable` cuts each param group's partition into pages: the pieces the offloaded step works on (ZeRO 1-2:
the rank's chunk of each bucket; ZeRO-3: each unit's segment of the group), each cut into pages of at most
``page_numel`` elements. So a step piece, or a unit's gather, always covers whole pages.

A :class:`PagedStore` holds, for every page, one or more *fields* of the same range (the optimizer tier: the fp32
master and both Adam moments; the parameter tier: the 16-bit shard). Each field of a group is one file
(``group{g}.{field}.tensor.swp``, sized and allocated at start), page after page at aligned offsets. The cache has
``slots`` host buffers (aligned, page-locked where a GPU is); a slot holds one page, every field.

* :meth:`PagedStore.acquire` pins a page in a slot (reading it unless the caller will overwrite all of it) and returns
  a :class:`Page` with one view per field; ``modify=True`` also waits until no write or device copy still reads the
  slot. :meth:`PagedStore.release` unpins it: ``dirty`` writes the page back behind the caller (the slot stays
  cached), ``busy`` (a copy handle with ``synchronize()``) keeps the slot from reuse until that copy completed.
* :meth:`PagedStore.prefetch` starts reading pages into free (or idle, least recently used) slots without waiting,
  so reads of the next pieces overlap the current one; it never waits and never evicts a pinned or busy page.
* a page is never read before it was written (``written``): a page of a state that does not exist yet (the moments
  before the first step) is zero-filled by the caller instead, and a read of an unwritten page is a bug that raises.

I/O errors (a full disk, a short read) raise :class:`~deepspeed.ops.aio.backends.AsyncIOError` from the call that
waits for them, naming the file; the page involved is dropped from the cache, so no half-read buffer is ever used.
The store is thread-safe: the offloaded step (a host worker) and the gathers (the training thread) share the
parameter tier.
"""

import itertools
import threading

import torch

from deepspeed.ops.aio.backends import ALIGNMENT
from deepspeed.ops.aio.buffers import aligned_empty, aligned_numel


class PageTable:
    """Per group, the pages ``(start, length)`` tiling ``[0, numel)`` (see the module docstring)."""

    def __init__(self, group_pieces, page_numel):
        """``group_pieces[g]``: the ``(start, length)`` pieces tiling group ``g``'s partition, in any order."""
        self.page_numel = max(1, int(page_numel))
        self.pages = []  # page index -> (group, start, length)
        self.group_pages = []  # group -> page indexes in offset order
        self.group_numel = []
        for g, pieces in enumerate(group_pieces):
            indexes = []
            covered = 0
            for start, length in sorted(p for p in pieces if p[1] > 0):
                if start != covered:
                    raise ValueError(f"PageTable: the pieces of group {g} leave a gap or overlap at {covered}")
                for lo in range(start, start + length, self.page_numel):
                    indexes.append(len(self.pages))
                    self.pages.append((g, lo, min(self.page_numel, start + length - lo)))
                covered = start + length
            self.group_pages.append(indexes)
            self.group_numel.append(covered)
        self._starts = [[self.pages[k][1] for k in indexes] for indexes in self.group_pages]

    @property
    def largest(self):
        return max((length for _, _, length in self.pages), default=1)

    def covering(self, group, start, length):
        """``[(page, offset in page, start, length)]``: the pages of group ``group`` that ``[start, start + length)``
        overlaps, with the overlapping range of each."""
        import bisect
        out = []
        starts = self._starts[group]
        i = max(0, bisect.bisect_right(starts, start) - 1)
        end = start + length
        indexes = self.group_pages[group]
        while i < len(indexes):
            page = indexes[i]
            _, lo, n = self.pages[page]
            if lo >= end:
                break
            a, b = max(lo, start), min(lo + n, end)
            if a < b:
                out.append((page, a - lo, a, b - a))
            i += 1
        return out


class Page:
    """A pinned page: ``fields[name]`` are views of its slot, ``start``/``length`` its range in the group."""

    __slots__ = ("index", "group", "start", "length", "fields")

    def __init__(self, index, group, start, length, fields):
        self.index = index
        self.group = group
        self.start = start
        self.length = length
        self.fields = fields


class _Ticket:
    """The completion of a set of aio requests, waited for once (its error kept for every later waiter)."""

    __slots__ = ("io", "ids", "done", "error", "lock")

    def __init__(self, io, ids):
        self.io = io
        self.ids = list(ids)
        self.done = not self.ids
        self.error = None
        self.lock = threading.Lock()

    def wait(self):
        if not self.done:
            with self.lock:
                if not self.done:
                    try:
                        for request_id in self.ids:
                            self.io.wait_op(request_id)
                    except BaseException as exc:
                        self.error = exc
                    self.done = True
        if self.error is not None:
            raise self.error

    def idle(self):
        """Whether waiting would not block (every request completed)."""
        return self.done or all(self.io.is_done(i) for i in self.ids)


_DONE = None


class _Entry:
    """A page's place in the cache.

    ``write`` is the page's last write-back, kept after the page leaves the cache: until it completed, the file does
    not hold the page, so a read of it (or a newer write) waits for it first.
    """

    __slots__ = ("slot", "refs", "last_use", "read", "write", "busy", "ready")

    def __init__(self):
        self.slot = None
        self.refs = 0
        self.last_use = 0
        self.read = None  # _Ticket of the read that fills the slot
        self.write = None  # _Ticket of the last write-back (see the class docstring)
        self.busy = []  # copies still reading the slot
        self.ready = None  # threading.Event: the slot is claimed and its read (if any) submitted


class _Evicted:
    """What still uses the slot of an evicted page: its read, its write-back and the copies reading it."""

    __slots__ = ("read", "write", "busy")

    def __init__(self, entry):
        self.read, self.write, self.busy = entry.read, entry.write, entry.busy


class PagedStore:
    """Pages of one or more fields on disk, behind ``slots`` cached host buffers (see the module docstring).

    ``fields`` maps a field name to its dtype; ``files[(g, name)]`` is the path of group ``g``'s file of that field
    (the groups without files are not stored). ``io`` is an aio engine (``deepspeed.ops.aio.backends``).
    """

    def __init__(self, table, fields, files, io, slots, pin=True):
        self.table = table
        self.fields = dict(fields)
        self.io = io
        largest = table.largest
        # per field: the aligned length of a page in the slot and in the file
        self._slot_numel = {name: aligned_numel(largest, dtype) for name, dtype in self.fields.items()}
        self.slots = max(1, min(int(slots), len(table.pages)))
        self._buffers = []
        for _ in range(self.slots):
            self._buffers.append({
                name: aligned_empty(n, self.fields[name], pin)
                for name, n in self._slot_numel.items()
            })
        self._files = dict(files)
        # file offset (bytes) of every page, per field: pages one after another, each padded to the alignment
        self._offsets = {}
        self.file_bytes = {}
        for g in sorted({g for g, _ in self._files}):
            indexes = table.group_pages[g]
            for name, dtype in self.fields.items():
                element = torch.empty((), dtype=dtype).element_size()
                at = 0
                for page in indexes:
                    self._offsets[(page, name)] = at
                    at += aligned_numel(table.pages[page][2], dtype) * element
                self.file_bytes[(g, name)] = at
        self.written = [False] * len(table.pages)
        self.stats = {"reads": 0, "writes": 0}  # pages submitted (tests check that the disk is used)
        self._entries = [_Entry() for _ in table.pages]
        self._free = list(range(self.slots))
        self._owner = [None] * self.slots  # slot -> page
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._tick = itertools.count(1)

    # ------------------------------------------------------------------ I/O
    def _views(self, page, slot):
        length = self.table.pages[page][2]
        return {name: self._buffers[slot][name].narrow(0, 0, length) for name in self.fields}

    def _submit(self, write, page, slot):
        g, _, length = self.table.pages[page]
        self.stats["writes" if write else "reads"] += 1
        ids = []
        for name, dtype in self.fields.items():
            buffer = self._buffers[slot][name]
            nbytes = aligned_numel(length, dtype) * buffer.element_size()
            ids.append(
                self.io.submit(write, buffer.data_ptr(), nbytes, self._files[(g, name)], None,
                               self._offsets[(page, name)]))
        return _Ticket(self.io, ids)

    # ---------------------------------------------------------------- cache
    def _victim_locked(self, for_prefetch, protected=()):
        """A slot to (re)use: a free one, else the least recently used unpinned page's (None if there is none).

        Returns ``(slot, evicted)`` (an :class:`_Evicted`, or None for a free slot); a prefetch takes only a slot whose
        page has no I/O or copy in flight, and never one of ``protected`` (pages about to be used).
        """
        if self._free:
            return self._free.pop(), None
        best = None
        for slot, page in enumerate(self._owner):
            entry = self._entries[page]
            if entry.refs or entry.ready is None or not entry.ready.is_set():
                continue
            if for_prefetch and (not self._idle(entry) or page in protected):
                continue
            if best is None or entry.last_use < self._entries[self._owner[best]].last_use:
                best = slot
        if best is None:
            return None, None
        page = self._owner[best]
        entry = self._entries[page]
        evicted = _Evicted(entry)
        entry.slot = None
        entry.read = None
        entry.busy = []
        self._owner[best] = None
        return best, evicted

    @staticmethod
    def _idle(entry):
        return ((entry.read is None or entry.read.idle()) and (entry.write is None or entry.write.idle())
                and all(copy.done() for copy in entry.busy))

    @staticmethod
    def _drain(evicted):
        """Wait for everything that still reads or fills an evicted page's slot (an :class:`_Evicted`). A failed
        write-back raises (the disk does not hold the page: nothing may read it back); a failed read only dropped a
        copy."""
        try:
            if evicted.read is not None:
                try:
                    evicted.read.wait()
                except Exception:
                    pass  # the page is evicted: nobody uses what the read left in the slot
            if evicted.write is not None:
                evicted.write.wait()
        finally:
            for copy in evicted.busy:
                copy.synchronize()

    def _claim(self, page, read, for_prefetch=False, protected=()):
        """Put ``page`` in a slot (with the lock held on entry and exit). Returns False when a prefetch found no
        slot (``protected``: pages a prefetch must not evict)."""
        entry = self._entries[page]
        while True:
            slot, evicted = self._victim_locked(for_prefetch, protected)
            if slot is not None:
                break
            if for_prefetch:
                return False
            self._changed.wait()
        entry.slot = slot
        self._owner[slot] = page
        entry.ready = threading.Event()
        entry.read = None
        entry.busy = []
        prior_write = entry.write  # the page's own last write-back: the file holds the page once it completed
        self._lock.release()
        try:
            if evicted is not None:
                self._drain(evicted)
            if read:
                if not self.written[page]:
                    path = self._files[(self.table.pages[page][0], next(iter(self.fields)))]
                    raise RuntimeError(f"paged store: page {page} of {path} is read before it was ever written")
                if prior_write is not None:
                    prior_write.wait()
                entry.read = self._submit(False, page, slot)
        except BaseException:
            self._lock.acquire()
            self._forget_locked(page)
            entry.ready.set()
            raise
        self._lock.acquire()
        entry.ready.set()
        self._changed.notify_all()
        return True

    def _forget_locked(self, page):
        entry = self._entries[page]
        if entry.slot is not None:
            self._owner[entry.slot] = None
            self._free.append(entry.slot)
            entry.slot = None
        self._changed.notify_all()

    def acquire(self, page, read=True, modify=False):
        """Pin ``page`` in a slot and return its :class:`Page` (see the module docstring).

        ``read=False``: the caller overwrites every element of every field (nothing is read). ``modify``: the caller
        writes into the slot, so pending write-backs and device copies of it complete first.
        """
        with self._lock:
            entry = self._entries[page]
            entry.refs += 1
            entry.last_use = next(self._tick)
            try:
                while True:
                    if entry.slot is None:
                        self._claim(page, read)
                    ready = entry.ready
                    if ready.is_set():
                        break
                    self._lock.release()
                    try:
                        ready.wait()
                    finally:
                        self._lock.acquire()
                slot = entry.slot
                read_ticket, write_ticket, busy = entry.read, entry.write, list(entry.busy)
            except BaseException:
                entry.refs -= 1
                raise
        try:
            if read_ticket is not None:
                read_ticket.wait()
            if modify:
                if write_ticket is not None:
                    write_ticket.wait()
                for copy in busy:
                    copy.synchronize()
        except BaseException:
            with self._lock:
                entry.refs -= 1
                self._forget_locked(page)  # never hand out a slot whose read failed
            raise
        if modify:
            with self._lock:
                entry.busy = [c for c in entry.busy if c not in busy]
        g, start, length = self.table.pages[page]
        return Page(page, g, start, length, self._views(page, slot))

    def release(self, page, dirty=False, busy=None):
        """Unpin ``page``; ``dirty``: write it back now (asynchronously); ``busy``: a copy reading its slot."""
        with self._lock:
            entry = self._entries[page]
            if dirty:
                entry.write = self._submit(True, page, entry.slot)
                self.written[page] = True
            if busy is not None:
                entry.busy.append(busy)
            entry.refs -= 1
            self._changed.notify_all()

    def prefetch(self, pages, keep=()):
        """Start reading ``pages`` (written ones, not cached yet) into free or idle slots; never waits. No page of
        ``pages`` or ``keep`` (the page about to be acquired) is evicted for it: reading ahead must not push out
        what is read next (the least recently used page is often the one the caller is about to take)."""
        protected = set(pages) | set(keep)
        with self._lock:
            for page in pages:
                entry = self._entries[page]
                if entry.slot is not None or not self.written[page]:
                    continue
                if entry.write is not None and not entry.write.idle():
                    continue  # its write-back is still in flight: reading it now would wait
                entry.last_use = next(self._tick)
                if not self._claim(page, True, for_prefetch=True, protected=protected):
                    return

    def flush(self):
        """Wait until every write-back completed (raise what one raised); the disk then holds every written page."""
        with self._lock:
            tickets = [e.write for e in self._entries if e.write is not None]
        for ticket in tickets:
            ticket.wait()

    def drop_cache(self):
        """Complete all I/O and copies, then empty the cache (nothing is pinned)."""
        self.flush()
        with self._lock:
            for page, entry in enumerate(self._entries):
                if entry.refs:
                    raise RuntimeError(f"paged store: page {page} is still pinned")
                if entry.slot is not None:
                    self._drain(_Evicted(entry))
                    entry.read, entry.busy = None, []
                    self._forget_locked(page)

    def cached_pages(self):
        with self._lock:
            return [p for p, e in enumerate(self._entries) if e.slot is not None]

    def nbytes(self):
        """Host bytes of the cache's buffers."""
        return sum(b.numel() * b.element_size() for slot in self._buffers for b in slot.values())


def io_aligned(nbytes):
    return -(-int(nbytes) // ALIGNMENT) * ALIGNMENT
