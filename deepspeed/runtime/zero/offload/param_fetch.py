# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3 parameter offload: this rank's row of a unit, from host 16-bit shards to the device, without stalls.

With ``offload_param`` the 16-bit shards live on the host. A gather (or a prefetch: the
coordinator launches the next unit's gather while the current one computes) needs the
rank's row of the unit on the device first. :class:`ShardFetch` issues that copy on a
side stream and returns its :class:`~deepspeed.runtime.zero.offload.transfers.Transfer`; the unit's
all-gather is launched behind it on the same stream and the compute stream waits only
when it uses the gathered parameters, so the copy of the next unit overlaps the current
unit's compute.

``offload_param.pin_memory`` decides how the copy reads the shards:

* pinned shards are copied straight to the device, asynchronously;
* pageable shards go through a ring of ``offload_param.buffer_count`` pinned buffers of
  ``offload_param.buffer_size`` elements (a host copy into the buffer, then the asynchronous
  upload); a buffer is reused once its upload completed, so pinned memory stays bounded.

Whoever writes the shards (the optimizer step, a checkpoint load) first waits for the
copies that read them (:meth:`ShardFetch.synchronize`).
"""

import torch

from deepspeed.runtime.zero.gradients.profiling import ds_range
from deepspeed.runtime.zero.offload.transfers import DONE, HostTransfers, PinnedRing, is_page_locked


class ShardFetch:
    """Uploads rows of host shards for gathers (see the module docstring)."""

    def __init__(self, device, dtype, *, buffer_count, buffer_numel, largest_row):
        self.device = torch.device(device)
        self.dtype = dtype
        self.transfers = HostTransfers(self.device)
        self._ring = None
        self._ring_args = (max(1, int(buffer_count)), max(1, min(int(buffer_numel), int(largest_row))))

    def fetch(self, pieces, numel, out=None):
        """A device row of ``numel`` elements (``out``, or a new one) filled from ``pieces`` (``(host tensor,
        column)`` pairs).

        Returns ``(row, transfer)``: the row may be read on the device once ``transfer`` was waited for.
        """
        row = torch.empty(numel, dtype=self.dtype, device=self.device) if out is None else out
        with ds_range("DS::param_fetch"):
            if all(is_page_locked(piece) for piece, _ in pieces) or self.transfers.stream is None:
                return row, self.transfers.copy_many([(row.narrow(0, column, piece.numel()), piece)
                                                      for piece, column in pieces])
            if self._ring is None:
                count, buffer_numel = self._ring_args
                self._ring = PinnedRing(count, buffer_numel, self.dtype)
            ring = self._ring
            last = DONE
            for piece, column in pieces:
                for start in range(0, piece.numel(), ring.numel):
                    length = min(ring.numel, piece.numel() - start)
                    index, buffer = ring.take(length)
                    buffer.copy_(piece.narrow(0, start, length))
                    last = self.transfers.copy(row.narrow(0, column + start, length), buffer)
                    ring.used_by(index, last)
            return row, last

    def synchronize(self):
        """Block until every upload issued so far completed (the shards may then be written)."""
        self.transfers.synchronize()
