# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3's offloaded step overlapping the next forward: stepped unit by unit, each gather waiting for its own units.

With ``offload_optimizer`` and the pipelined host step (``step_pipeline.py``), :class:`UnitStep` launches the
step on the host worker and ``engine.step()`` returns at once. The pieces are the units' segments of each
param group's partition (``UnitPartitionLayout.segments``: a unit's piece of a group is one contiguous run of
the masters, the gradient partition and the 16-bit shards), in the order the next forward gathers the units:
the persistent unit first (re-gathered at the end of ``step()``), then the units in the order the first
forward gathered them (the coordinator's trace), then any unit that forward did not use.

A unit's gather (``Stage3._send_chunk``, on demand or as a prefetch, in a forward, a backward, an eval
forward or ``unwrap_model_for_generation``) first calls :meth:`UnitStep.wait_for`: the host waits until the
last piece covering the unit's shard elements is stepped and its send issued (the pieces are stepped one
after another, so every earlier piece is stepped too), and the compute stream waits for the sends:

* with ``offload_param`` the step writes the host shards the gather copies from: a host piece needs no
  send (the host wait is enough); a piece of the device share (``offload_optimizer.ratio``) is copied down
  into the host shards on the share's stream, so its send is a marker after that copy on the host step's
  transfer stream and the gather's host waits for it (the ring of pageable shards reads them on the host);
* with the optimizer offloaded only, each piece's 16-bit values are uploaded into the device shards as soon
  as it is stepped (the transfer stream, behind the device share for its pieces) and the gather, which casts
  from the device shards on the compute stream, makes that stream wait for the upload.

The waits are by piece index, not by position in the forward: a forward that gathers in another order than
the recorded one (a dynamic graph, an eval forward of another shape) waits for what it needs, only slower.
Everything else that reads or writes what the step touches completes it first (``Stage3``: the gradient
folds of the next backward, accessors, checkpoints, ``state_dict``, ``GatheredParameters``, a refresh of the
16-bit shards, the next step).
"""

import torch

from deepspeed.runtime.zero.offload.step_pipeline import StepPiece
from deepspeed.runtime.zero.offload.transfers import DONE, Transfer


class UnitStep:
    """The overlapped ZeRO-3 offloaded step of ``stage`` (a ``Stage3``; see the module docstring)."""

    def __init__(self, stage):
        self.stage = stage
        self.through = {}  # unit index -> index of the last piece its gather waits for (the running step)

    def order(self):
        """The units in the order the next forward gathers them (the module docstring)."""
        units = self.stage.units
        first = [u for u in units if u.persistent]
        traced = [u for u in self.stage.coordinator.forward_order() if not u.persistent]
        seen = {u.index for u in first + traced}
        rest = sorted((u for u in units if u.index not in seen), key=lambda u: -u.index)
        return first + traced + rest

    def spans(self):
        """``(spans, owners)``: every stepped group's partition as unit segments in :meth:`order`, and the unit of
        each span."""
        stage = self.stage
        groups = stage.optimizer.param_groups
        num_groups = len(stage.masters)
        spans, owners = [], []
        covered = [0] * num_groups
        for unit in self.order():
            for g, part_offset, _, length in stage.layout.segments[unit.index]:
                if g >= num_groups or length == 0 or not groups[g]["params"]:
                    continue
                spans.append((g, part_offset, length))
                owners.append(unit.index)
                covered[g] += length
        for g, numel in enumerate(stage.host_step.group_numel):
            if groups[g]["params"] and covered[g] != numel:
                raise RuntimeError(f"UnitStep: the units' segments cover {covered[g]} of the {numel} "
                                   f"elements of param group {g}'s partition")
        return spans, owners

    def launch(self, grad_scale, begun=None):
        """Start the step in the background; the next gathers wait through :meth:`wait_for`. ``begun`` (a kept
        speculative step's ``(prepared, stepped)``, ``speculative_step``) continues it: its pieces are only sent."""
        stage = self.stage
        host_step = stage.host_step
        spans, owners = self.spans()
        send_for = self._share_marker if stage.fetch is not None else self._upload_into_shards
        last = host_step.step_spans(spans,
                                    send_for,
                                    grad_scale=grad_scale,
                                    background=True,
                                    before_write=stage.fetch,
                                    begun=begun)
        through = {}
        for unit_index, piece in zip(owners, last):
            through[unit_index] = max(through.get(unit_index, -1), piece)
        self.through = through

    def speculative_pieces(self):
        """The step's pieces for ``SpeculativeStep``: each unit's segment of a group, keyed by its gradient
        partition piece (what the unit's fold writes), ranked so that the first in the next forward's gather order
        has the largest rank."""
        grad_parts = self.stage.geometry.grad_parts  # not partitions(): that settles the folds
        spans, _ = self.spans()
        pieces = {}
        for position, (g, start, length) in enumerate(spans):
            dest = grad_parts[g].narrow(0, start, length)
            pieces[(dest.data_ptr(), length)] = (len(spans) - position, StepPiece(g, start, length))
        return pieces

    def wait_for(self, unit):
        """Before ``unit``'s shards are read for a gather: the pieces covering them are stepped and sent."""
        if self.through:
            self.stage.host_step.wait_for_piece(self.through.get(unit.index, -1))

    # ------------------------------------------------------------- sends
    def _upload_into_shards(self, g, start, length, on_device):
        """Optimizer offload only: the piece's 16-bit values into the device shards, on the transfer stream."""
        transfers = self.stage.host_step.transfers
        dst = self.stage.shards[g].narrow(0, start, length)

        def send(target):
            # the worker queues no device work of its own; the launch ordered the stream after the compute stream
            return transfers.copy(dst, target, wait_producer=False)

        return send

    def _share_marker(self, g, start, length, on_device):
        """Parameter offload: the host shards are the targets; only a device-share piece has something to wait for
        (its copy down, which the launch ordered the transfer stream after)."""
        if not on_device:
            return None
        stream = self.stage.host_step.transfers.stream

        def send(target):
            if stream is None:
                return DONE
            event = torch.cuda.Event()
            event.record(stream)
            return _HostVisible(Transfer(event, stream))

        return send


class _HostVisible:
    """A copy into host memory that a gather may read on the host: waiting for it blocks the host."""

    __slots__ = ("transfer", )

    def __init__(self, transfer):
        self.transfer = transfer

    def wait_stream(self, stream=None):
        self.transfer.synchronize()
