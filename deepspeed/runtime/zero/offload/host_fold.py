# SPDX-License-Identifier: Apache-2.0
"""Folding reduced gradient chunks into host (offloaded) partitions without stalling the device.

With ``offload_optimizer`` a rank's window-gradient partitions live on the host. A
geometry hands every reduced chunk to :meth:`HostFolder.fold` with the host piece it
belongs to; the folder makes ``piece += chunk`` true by the time anyone reads the
partitions, and keeps the device and the caller's thread running meanwhile:

* the first fold of a piece in a window is a copy, not an add (the partition is not
  zeroed between windows; see lazy zeroing below). When the piece is page-locked and
  of the chunk's dtype, the chunk is copied straight into it, device to host, on the
  transfer stream: no host work at all;
* every other fold copies the chunk, on the transfer stream, into a buffer of a bounded
  ring of pinned buffers, and queues ``piece += buffer`` (or ``piece.copy_(buffer)``) on a
  :class:`~deepspeed.runtime.zero.offload.host_worker.HostWorker` thread, which waits for that copy
  and adds while the device goes on with the backward. A ring buffer is reused only after
  its add completed, so pinned memory stays bounded (``ring_count`` x ``ring_numel``);
* direct copies in flight are bounded too (``max_pending``): each keeps its device chunk
  alive until it is done.

:meth:`settle` completes everything (every copy and add) and must run before the host
partitions are read or written by anyone else: the geometry calls it from
``partitions()``. Lazy zeroing: :meth:`new_window` forgets which pieces were written;
a registered piece that no fold reached in a window is zeroed by the first
``settle()`` after it. So a window costs no host pass to zero the partitions.

Why the host adds (measured, docs/offload.md): accumulating the whole window on the
device and copying once at the boundary needs a device buffer as large as the rank's
fp32 gradient (ZeRO-1 with offload does exactly that, with its persistent staging);
ZeRO-2 keeps no full gradient on the device, so its later micro-steps add on the host,
in parallel with the device.

On a machine without CUDA the copies are plain copies and the adds still run on the
worker thread, so the ordering logic is the same one the GPU runs.
"""

from collections import deque

import torch

from deepspeed.runtime.zero.offload.host_worker import HostWorker, host_cores
from deepspeed.runtime.zero.gradients.profiling import ds_range
from deepspeed.runtime.zero.offload.transfers import DONE, HostTransfers, PinnedRing, is_page_locked

# Ring of pinned buffers for chunks that are added on the host: count, and elements per buffer (a cap;
# smaller when no chunk is that large). 32 x 32 MiB lets the copies of several buckets run ahead of the
# adds, so the backward does not wait for the host (measured: with 8 buffers the thread driving the
# backward waited about 0.1 s per micro-step on the reference offload run).
RING_COUNT = 32
RING_NUMEL = 1 << 23
# Direct device-to-host copies in flight before the caller waits for the oldest (each keeps its device chunk).
MAX_PENDING = 2


def default_threads():
    """Threads of the adding worker: every core but two, which stay with the thread that drives the device."""
    return max(1, host_cores() - 2)


class HostFolder:
    """Folds device chunks into host partition pieces (see the module docstring)."""

    def __init__(self,
                 device,
                 *,
                 ring_count=RING_COUNT,
                 ring_numel=RING_NUMEL,
                 max_pending=MAX_PENDING,
                 threads=None,
                 name="ds-host-fold"):
        self.device = torch.device(device)
        self.transfers = HostTransfers(self.device)
        self.worker = HostWorker(name, threads or default_threads())
        self._ring_count = ring_count
        self._ring_cap = int(ring_numel)
        self._max_pending = max(1, int(max_pending))
        self._rings = {}  # dtype -> PinnedRing
        self._pending = deque()
        self._pieces = {}  # key -> registered piece
        self._written = set()
        self._largest = 0
        self.folds = 0  # folds since the last new_window (tests read it)
        # Called before the partitions are written or read (an offloaded step still reading them finishes first).
        self.barrier = None
        # Speculative steps (``speculative_step``): ``before_fold(piece)`` replaces ``barrier`` before a fold, and
        # ``after_fold(piece, done)`` learns when the folds of ``piece`` issued so far complete (``done``).
        self.before_fold = None
        self.after_fold = None

    @staticmethod
    def _key(piece):
        return (piece.data_ptr(), piece.numel())

    def register(self, piece):
        """``piece`` (a view of a host partition) receives folds; an unwritten piece reads as zero after settle."""
        if piece.numel():
            self._pieces[self._key(piece)] = piece
            self._largest = max(self._largest, piece.numel())

    def clear_pieces(self):
        """Forget every registered piece (the partitions are being replaced; settle first)."""
        self._pieces = {}
        self._written = set()

    def _ring(self, dtype):
        ring = self._rings.get(dtype)
        if ring is None:
            numel = max(1, min(self._ring_cap, self._largest or self._ring_cap))
            ring = self._rings[dtype] = PinnedRing(self._ring_count, numel, dtype, pin_memory=True)
        return ring

    def fold(self, piece, chunk):
        """``piece += chunk`` (``piece`` on the host, ``chunk`` anywhere), complete by the next :meth:`settle`.

        Returns the :class:`~deepspeed.runtime.zero.offload.transfers.Transfer` after which ``chunk`` was read:
        the caller may drop ``chunk`` at once (its memory is recorded on the transfer stream), but
        must make the device wait for it (``wait_stream()``) before writing into ``chunk`` again.
        """
        numel = piece.numel()
        if numel == 0:
            return DONE
        if self.before_fold is not None:
            self.before_fold(piece)
        elif self.barrier is not None:
            self.barrier()
        key = self._key(piece)
        fresh = key not in self._written
        self._written.add(key)
        self.folds += 1
        with ds_range("DS::host_fold"):
            if fresh and chunk.dtype == piece.dtype and is_page_locked(piece) and chunk.device.type == "cuda":
                copied = self.transfers.copy(piece, chunk)
                self._pending.append(copied)
                while len(self._pending) > self._max_pending:
                    self._pending.popleft().synchronize()
                done = copied
            else:
                ring = self._ring(chunk.dtype)
                flat_piece, flat_chunk = piece.reshape(-1), chunk.reshape(-1)
                for start in range(0, numel, ring.numel):
                    length = min(ring.numel, numel - start)
                    index, buffer = ring.take(length)
                    copied = self.transfers.copy(buffer, flat_chunk.narrow(0, start, length))
                    target = flat_piece.narrow(0, start, length)
                    done = self.worker.submit(_host_fold_task(copied, target, buffer, fresh))
                    ring.used_by(index, done)  # the worker runs in order: the last add completes the piece
        if self.after_fold is not None:
            self.after_fold(piece, done)
        return copied

    def settle(self):
        """Complete every fold issued so far, and zero the registered pieces this window did not write."""
        if self.barrier is not None:
            self.barrier()
        with ds_range("DS::host_settle"):
            while self._pending:
                self._pending.popleft().synchronize()
            self.worker.drain()
            for key, piece in self._pieces.items():
                if key not in self._written:
                    piece.zero_()
                    self._written.add(key)

    def new_window(self):
        """A new accumulation window: the next fold of every piece overwrites it."""
        while self._pending:
            self._pending.popleft().synchronize()
        self.worker.drain()
        self._written = set()
        self.folds = 0

    def close(self):
        self.new_window()
        self.worker.close()
        self._rings = {}
        self._pieces = {}


def _host_fold_task(copied, target, buffer, fresh):

    def run():
        copied.synchronize()
        if fresh:
            target.copy_(buffer)
        else:
            target.add_(buffer)

    return run
