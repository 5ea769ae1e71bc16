# SPDX-License-Identifier: Apache-2.0
"""The offloaded optimizer step, piece by piece: each piece uploaded as soon as it is stepped.

The host Adam op steps any split of a partition to the same bits as one call (the update is
elementwise; ``deepspeed.ops.adam.host_adam.step_piece``). :class:`StepPipeline` uses that to overlap
the three phases of an offloaded step that used to run one after the other:

* the partition is cut into *pieces* (ZeRO 1-2: the rank's chunk of one bucket), stepped in the order
  the next forward needs them (the first layers first);
* as soon as a piece is stepped, its 16-bit values (written by the op into the pinned upload buffer in
  the same pass) are copied to the device on the transfer stream (and, on several ranks, all-gathered
  behind that copy), while the host steps the next piece;
* with ``background``, the pieces are stepped on a host worker thread and :meth:`launch` returns at
  once: the next forward starts while the host steps the last pieces, and each module's forward waits
  (:meth:`wait_through`) only for the pieces holding its parameters: the host waits until the piece is
  stepped and its copy issued, the compute stream waits for the copy on the device.

The clipping coefficient is applied by the op as it reads the gradient (``grad_scale``): the same
float32 product a separate ``grad *= coef`` pass would store, so no pass of its own.

Everything that reads or writes what the step touches (the masters, the moments, the gradient
partitions, the upload buffers, the model's parameters outside a waited forward) calls :meth:`finish`
first. Every scalar of the step (learning rate, betas, the step count) is read at :meth:`launch`, on
the caller's thread: an LR scheduler that changes the param groups after ``engine.step()`` returns does
not race with the worker.

``DS_OFFLOAD_OVERLAP=0`` turns the pipeline off (the stages step the whole partition, scale the
gradient in a pass of its own and upload afterwards: the reference the tests compare against);
:attr:`StepPipeline.piece_delay` slows every piece on purpose (tests: the ordering must hold when the
host is slow).
"""

import os
import threading
import time

import torch

from deepspeed.ops.adam import host_adam
from deepspeed.runtime.zero.offload.host_worker import HostWorker
from deepspeed.runtime.zero.gradients.profiling import ds_range
from deepspeed.runtime.zero.offload.transfers import DONE, synchronous_copies

_MOMENTS = ("exp_avg", "exp_avg_sq")


def overlap_enabled():
    """Whether offloaded steps are pipelined (``DS_OFFLOAD_OVERLAP`` is not ``0``, and ``DS_OFFLOAD_SYNC=1``, every
    copy a blocking one, is not set)."""
    return os.environ.get("DS_OFFLOAD_OVERLAP", "1") != "0" and not synchronous_copies()


class StepPiece:
    """Elements ``[start, start + length)`` of param group ``group``'s partition, stepped and sent on as one.

    ``send(target)`` issues the device copy (and collective) of the piece's 16-bit values ``target`` and
    returns the handle the device waits for (``wait_stream()``), or None.
    """

    __slots__ = ("group", "start", "length", "send", "on_device")

    def __init__(self, group, start, length, send=None, on_device=False):
        self.group = group
        self.start = start
        self.length = length
        self.send = send
        self.on_device = on_device  # stepped by the host step's DeviceShare (partial offload), not the host


class _Launch:
    """One launched step: per piece, the host event (stepped, copy issued) and the copy's handle."""

    def __init__(self, count):
        self.stepped = [threading.Event() for _ in range(count)]
        self.sent = [DONE] * count
        self.waited = -1  # pieces up to this index are waited for on the compute stream
        self.task = None
        self.error = None


class StepPipeline:
    """Pipelined host steps of one :class:`~deepspeed.runtime.zero.offload.offload_step.HostStep` (module
    docstring)."""

    piece_delay = 0.0  # seconds slept before each piece (tests)

    def __init__(self, host_step):
        self.host_step = host_step
        self.worker = None
        self._launch = None

    @staticmethod
    def supported(host_step):
        """Whether the step can be pipelined: DeepSpeedCPUAdam on the host op, float32 masters and gradients."""
        if not overlap_enabled() or not host_step.writes_16bit:
            return False
        optimizer = host_step.optimizer
        if not hasattr(optimizer, "_state_for") or host_adam.native_policy() == "never":
            return False
        if host_adam.host_adam_op() is None:
            return False
        for group, master, target in zip(optimizer.param_groups, host_step.masters, host_step.targets):
            if not group["params"]:
                continue
            if group["params"] != [master] or not host_adam.group_supported(group):
                return False
            if master.dtype != torch.float32:  # 16-bit masters (*_master_weights_and_grads): the optimizer's step
                return False
            if target.dtype == torch.float32:
                # DeepSpeedCPUAdam steps an fp32 model on torch's kernels unless DS_NATIVE_CPU_ADAM=1: the
                # pipeline (on the op) would change the numbers
                if host_adam.native_policy() != "all":
                    return False
            elif not host_adam.copy_target_supported(host_adam.host_adam_op(), target, master):
                return False
        return True

    @property
    def pending(self):
        """Whether a launched step may still be running."""
        return self._launch is not None

    def prepare(self):
        """Per group: (master, grad, state, scalars), the step counted and its scalars read now (the master is None
        when the optimizer tier keeps it on disk)."""
        host_step = self.host_step
        if host_step.swap is not None:
            return host_step.swap.prepare()
        optimizer = host_step.optimizer
        prepared = {}
        for g, group, master, grad in host_step.stepped_groups():
            if not host_adam.tensor_supported(master.data, grad):
                raise ValueError("StepPipeline: the masters and their gradients must be contiguous float32 host "
                                 "tensors")
            state = optimizer._state_for(master, master, group)
            prepared[g] = (master.data, grad, state, host_adam.begin_step(group, master.data, state))
        return prepared

    def step_host_piece(self, entry, piece, grad_scale=1.0, backup=None, out=None, out_range=None):
        """Step host piece ``piece`` with ``entry`` (one group's value of :meth:`prepare`): its masters, moments and
        16-bit target (``out``: another tensor of the target's shape and dtype receives the 16-bit values instead;
        ``out_range``: a tensor of the piece's length does); ``backup`` (a ``host_adam.StepBackup`` of the group)
        first receives what it overwrites."""
        host_step = self.host_step
        param, grad, state, scalars = entry
        if out_range is not None:
            full, at = out_range, 0
        else:
            full, at = (host_step.targets[piece.group] if out is None else out), piece.start
        writes = full.dtype != torch.float32  # the op writes a 16-bit copy in its pass
        if backup is not None and not writes:
            backup.out.narrow(0, piece.start, piece.length).copy_(full.narrow(0, at, piece.length))
        if out_range is not None:  # the op addresses every tensor from one start: hand it views of the piece
            if backup is not None:
                raise ValueError("StepPipeline.step_host_piece: a backup needs the whole target")
            views = {k: v.narrow(0, piece.start, piece.length) for k, v in state.items() if k in _MOMENTS}
            host_adam.step_piece(host_adam.host_adam_op(), host_step.optimizer.param_groups[piece.group], scalars,
                                 param.narrow(0, piece.start, piece.length), grad.narrow(0, piece.start, piece.length),
                                 views, 0, piece.length, full if writes else None, grad_scale, host_step.threads)
        else:
            host_adam.step_piece(host_adam.host_adam_op(), host_step.optimizer.param_groups[piece.group], scalars,
                                 param, grad, state, piece.start, piece.length, full if writes else None, grad_scale,
                                 host_step.threads, backup)
        if not writes:  # an fp32 model: the targets are copies of the masters
            full.narrow(0, at, piece.length).copy_(param.narrow(0, piece.start, piece.length))

    def step_piece(self, entry, piece, grad_scale=1.0):
        """Step ``piece``: from host memory (:meth:`step_host_piece`), or page by page where the masters (the
        optimizer tier, ``host_step.swap``) or the 16-bit targets (ZeRO-3's parameter tier, ``host_step.shard_tier``)
        are on disk."""
        host_step = self.host_step
        swap, shards = host_step.swap, host_step.shard_tier
        if swap is None and (shards is None or shards.resident):
            self.step_host_piece(entry, piece, grad_scale)
            return
        table = swap.table if swap is not None else shards.table
        for page, offset, start, length in table.covering(piece.group, piece.start, piece.length):
            if shards is not None and not shards.resident:
                out = shards.open_target(page, offset, length)
            else:
                out = host_step.targets[piece.group].narrow(0, start, length)
            try:
                if swap is not None:
                    swap.step_range(entry, piece.group, start, length, out, grad_scale, host_step.threads)
                else:
                    self.step_host_piece(entry, StepPiece(piece.group, start, length), grad_scale, out_range=out)
            finally:
                if shards is not None and not shards.resident:
                    shards.close_target(page)

    def host_worker(self):
        """The worker thread the host steps run on (created on first use)."""
        if self.worker is None:
            self.worker = HostWorker("ds-host-step", self.host_step.threads)
        return self.worker

    def launch(self, pieces, grad_scale=1.0, background=False, prepared=None, stepped=()):
        """Step every piece in order, uploading each when stepped; with ``background`` return before it is done.

        ``prepared`` (from :meth:`prepare`, the step already counted) and ``stepped`` (indexes of ``pieces`` whose
        host values are already this step's: a speculative step's, ``speculative_step``) continue a step begun
        earlier: those pieces are only sent. The caller made sure nothing still reads the targets
        (``HostStep.wait_readers``).
        """
        self.finish()
        swap = self.host_step.swap
        if swap is not None:  # the state goes to disk first if something made it resident; reads run ahead of
            swap.swap_out()  # the pieces in their order
            swap.plan_pieces(pieces)
        if prepared is None:
            prepared = self.prepare()
        share = self.host_step.share
        if share is not None:
            if stepped:
                raise ValueError("StepPipeline.launch: a device share cannot continue a step begun earlier")
            share.launch(self.host_step.optimizer.param_groups, {
                g: e[2]
                for g, e in prepared.items()
            }, {
                g: e[3]
                for g, e in prepared.items()
            }, {
                g: e[1]
                for g, e in prepared.items()
            }, grad_scale)
        launch = _Launch(len(pieces))
        transfers = self.host_step.transfers
        targets = self.host_step.targets
        device = self.host_step.device
        delay = self.piece_delay
        stepped = frozenset(stepped)

        def run():
            with ds_range("DS::host_step_pieces"):
                try:
                    for index, piece in enumerate(pieces):
                        if delay and index not in stepped:
                            time.sleep(delay)
                        target = None if targets[piece.group] is None else targets[piece.group].narrow(
                            0, piece.start, piece.length)
                        if piece.on_device:  # its 16-bit values arrive from the device share's stream
                            share.order_after(transfers.stream)
                        elif index not in stepped and piece.group in prepared:
                            self.step_piece(prepared[piece.group], piece, grad_scale)
                        if piece.send is not None:
                            launch.sent[index] = piece.send(target) or DONE
                        launch.stepped[index].set()
                    if swap is not None:
                        swap.finish_step(prepared)
                    shards = self.host_step.shard_tier
                    if shards is not None and not shards.resident:
                        shards.finish_writes()  # a write that failed raises here, not at a later read
                except BaseException as exc:
                    launch.error = exc
                    for event in launch.stepped:
                        event.set()
                    raise

        def in_device_context():
            if device.type == "cuda":
                with torch.cuda.device(device):
                    run()
            else:
                run()

        self._launch = launch
        if background:
            launch.task = self.host_worker().submit(in_device_context)
        else:
            try:
                in_device_context()
            finally:
                self._launch = None
            self._wait_stream(launch, len(pieces) - 1)
            if share is not None:  # the targets are complete on the host when a foreground step returns
                share.wait_host()

    @staticmethod
    def _wait_stream(launch, index):
        for k in range(launch.waited + 1, index + 1):
            launch.sent[k].wait_stream()
        launch.waited = max(launch.waited, index)

    def wait_through(self, index):
        """The host waits until pieces ``0..index`` are stepped and sent; the compute stream waits for their
        copies on the device."""
        launch = self._launch
        if launch is None or index <= launch.waited:
            return
        index = min(index, len(launch.stepped) - 1)
        with ds_range("DS::wait_step_piece"):
            launch.stepped[index].wait()
            if launch.error is not None:
                self.finish()
            self._wait_stream(launch, index)

    def finish(self):
        """Complete a launched step (the compute stream waits for every upload); raise what it raised."""
        launch, self._launch = self._launch, None
        if launch is None:
            return
        with ds_range("DS::wait_step"):
            if launch.task is not None:
                launch.task.synchronize()
            self._wait_stream(launch, len(launch.stepped) - 1)
            if self.host_step.share is not None:
                self.host_step.share.wait_host()

    def close(self):
        try:
            self.finish()
        finally:
            if self.worker is not None:
                self.worker.close()
                self.worker = None
