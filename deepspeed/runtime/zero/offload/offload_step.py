# SPDX-License-Identifier: Apache-2.0
"""The optimizer step of offloaded (host) fp32 masters, and the way its 16-bit result reaches the device.

:class:`HostStep` is what ZeRO stages 1-3 run at the boundary when ``offload_optimizer`` puts
the masters and the optimizer state on the host:

1. the inner optimizer steps the host masters with ``offload_optimizer.cpuadam_cores_perc``
   of the cores (torch's intra-op threads, restored afterwards);
2. the updated masters, in the model dtype, land in *16-bit targets*: pinned host buffers
   (``uploads``, one per param group, the shape of the group's partition) by default, or
   the host 16-bit shards of ZeRO-3 parameter offload. An optimizer whose ``step`` takes
   ``fp16_param_groups`` (``DeepSpeedCPUAdam``) writes them in the same pass; any other
   optimizer steps and the masters are cast afterwards;
3. the targets are uploaded with asynchronous copies on a side stream
   (:meth:`gather_into` for stages 1 and 2: per bucket, each bucket's upload overlapping the
   previous bucket's all-gather; :meth:`upload` for ZeRO-3 shards on the device). The
   compute stream waits for them on the device, never the host.

Before the step writes the targets again, the host waits for the copies that read them
(a buffer an asynchronous copy reads must not change under it).

Pipelined (:mod:`~deepspeed.runtime.zero.offload.step_pipeline`, with ``DeepSpeedCPUAdam`` on the host op):
:meth:`step_and_gather` steps the partition bucket by bucket in the order the next forward needs them,
uploads (and all-gathers) each bucket as soon as it is stepped, applies the clipping coefficient as the
op reads the gradient, and on one rank may return before the last bucket is stepped (each module's
forward then waits for its own buckets, :meth:`wait_for_piece`). Same bits as the whole step.
:meth:`step_spans` is the same for ZeRO-3: spans of the partitions in the order the next forward gathers
the units, returning at once (each unit's gather waits for its own spans).

After anything else changed the masters (a checkpoint load, ``safe_set_full_fp32_param``),
:meth:`refresh` recomputes the targets from them; :meth:`gather_into` and the stages do so
when the step did not just write them (``fresh``).
"""

import inspect

import torch

import deepspeed.comm as dist
from deepspeed.runtime.zero.gradients import grad_ops
from deepspeed.runtime.zero.offload.device_share import DeviceShare
from deepspeed.runtime.zero.offload.host_worker import cores_for, threads
from deepspeed.runtime.zero.gradients.profiling import ds_range
from deepspeed.runtime.zero.offload.step_pipeline import StepPiece, StepPipeline
from deepspeed.runtime.zero.offload.transfers import DONE, HostTransfers, pinned_empty

# Why a step is not pipelined, for the errors of what needs it (``what``; ``instead``: the way out).
NEEDS_PIPELINE = ("{what} needs the pipelined host step: DeepSpeedCPUAdam (optimizer type Adam or AdamW without "
                  "\"torch_adam\") on the host Adam op (a C++ compiler, DS_NATIVE_CPU_ADAM not 0), a bf16/fp16 model "
                  "(an fp32 one with DS_NATIVE_CPU_ADAM=1), no amsgrad, and DS_OFFLOAD_OVERLAP / DS_OFFLOAD_SYNC not "
                  "set to turn it off; {instead} (docs/offload.md)")

# Elements cast per chunk when the masters are cast into the targets after the step.
CAST_CHUNK = 1 << 24


def writes_16bit_copy(optimizer):
    """Whether ``optimizer.step`` accepts ``fp16_param_groups`` (it then writes the 16-bit copy in its pass)."""
    try:
        return "fp16_param_groups" in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        return False


class HostStep:
    """Steps host masters and moves their 16-bit values to the device (see the module docstring).

    ``masters[g]`` is param group ``g``'s flat fp32 master on the host (the inner optimizer steps
    it); ``targets`` (default: new pinned buffers) are the 16-bit tensors, one per group, that
    receive the masters after each step.
    """

    def __init__(self,
                 optimizer,
                 masters,
                 model_dtype,
                 device,
                 *,
                 pin_memory,
                 cores_perc=0.8,
                 threads=None,
                 targets=None,
                 device_ranges=None,
                 disk=None,
                 page_table=None,
                 rank=0):
        self.optimizer = optimizer
        self.masters = masters
        self.group_numel = [m.numel() for m in masters]  # the masters' sizes (a swapped-out master's data is empty)
        self.model_dtype = model_dtype
        self.device = torch.device(device)
        self.threads = int(threads) if threads else cores_for(cores_perc)
        if targets is None:
            targets = [pinned_empty(m.numel(), model_dtype, pin_memory) for m in masters]
        self.targets = targets
        self.transfers = HostTransfers(self.device)
        self._fused_copy = writes_16bit_copy(optimizer)
        self._reading = DONE  # the last copy that reads the targets
        self.fresh = False  # the targets hold the masters' current values
        self.pipeline = StepPipeline(self) if StepPipeline.supported(self) else None
        self.swap = None  # the optimizer tier (offload_optimizer.device nvme): masters and state on disk
        self.shard_tier = None  # ZeRO-3's parameter tier (offload_param.device nvme), when the targets are its shards
        self._paged = None  # the whole-partition step range by range (``paged_step``), where a tier is on disk
        self._pageable = None  # the optimizer's per-element state fields, once probed (None: not probed)
        if disk is not None:
            self._attach_optimizer_tier(disk, page_table, rank)
        self.share = None  # partial offload: the ranges the device steps (``device_ranges``, DeviceShare)
        if device_ranges:
            if self.pipeline is None:
                self.close()
                raise NotImplementedError(
                    NEEDS_PIPELINE.format(what="zero_optimization.offload_optimizer.ratio < 1 "
                                          "(partial offload)",
                                          instead="set offload_optimizer.ratio to 1"))
            self.share = DeviceShare(self, device_ranges, self.device)

    def stepped_groups(self):
        """``(index, param group, master, its gradient)`` of every param group this step updates (one with
        parameters and a gradient)."""
        for g, group in enumerate(self.optimizer.param_groups):
            if group["params"] and self.masters[g].grad is not None:
                yield g, group, self.masters[g], self.masters[g].grad

    def _attach_optimizer_tier(self, disk, page_table, rank):
        """The optimizer tier on every path: paged by the pieces (``page_table``) for the pipelined step, on the
        aligned grid of ``paged_step`` for the inner optimizer's own step; NotPageableError where that step is not
        elementwise (``paged_step.probe_state_fields``)."""
        from deepspeed.runtime.swap_tensor.optimizer_swap import MOMENTS, OptimizerStateSwap
        from deepspeed.runtime.swap_tensor.paged_step import PagedStep, grid_table
        fields = self.pageable_fields()
        if self.pipeline is not None:
            if set(fields) != set(MOMENTS):
                raise ValueError(f"HostStep: the pipelined step pages Adam's moments, the optimizer keeps {fields}")
            table = page_table
        else:
            table = grid_table(self.group_numel, disk.page_numel)
        self.swap = OptimizerStateSwap(self, table, disk, rank, fields)
        self._paged = PagedStep(self)

    def pageable_fields(self):
        """The inner optimizer's per-element state fields (``paged_step.probe_state_fields``: NotPageableError where
        its step is not elementwise)."""
        if self._pageable is None:
            from deepspeed.runtime.swap_tensor.paged_step import probe_state_fields
            self._pageable = probe_state_fields(self.optimizer, self.model_dtype, self._fused_copy)
        return self._pageable

    def attach_shard_tier(self, tier):
        """ZeRO-3's parameter tier holds this step's targets (the 16-bit shards) while swapped: a step that is not
        pipelined writes them range by range (on the optimizer tier's pages, or on an aligned grid of the
        parameter tier's page size; whole groups where the optimizer is not elementwise)."""
        from deepspeed.runtime.swap_tensor.paged_step import NotPageableError, PagedStep, grid_table
        self.shard_tier = tier
        if self._paged is None:
            try:
                self.pageable_fields()
                page = tier.config.page_numel
            except NotPageableError:
                page = max(self.group_numel + [1])
            self._paged = PagedStep(self, grid_table(self.group_numel, page))

    def _states(self):
        return {g: self.optimizer.state[m] for g, m in enumerate(self.masters) if self.optimizer.state.get(m)}

    def sync_host(self):
        """Before the host masters or moments are read or written outside a step: the step completes, the optimizer
        tier's state is read back into host tensors, and a device share's values are copied down (the next step
        uploads them again)."""
        self.finish()
        if self.swap is not None:
            self.swap.swap_in()
        if self.share is not None:
            self.share.sync_host(self._states())

    def _device_pieces(self, g, start, length):
        """Split ``[start, start + length)`` of group ``g`` into host and device pieces (partial offload)."""
        cuts = [(start, start + length, False)]
        for r in (self.share.ranges if self.share is not None else []):
            if r.group != g:
                continue
            out = []
            for lo, hi, dev in cuts:
                a, b = max(lo, r.start), min(hi, r.start + r.length)
                if dev or a >= b:
                    out.append((lo, hi, dev))
                    continue
                out += [x for x in ((lo, a, False), (a, b, True), (b, hi, False)) if x[1] > x[0]]
            cuts = out
        return cuts

    @property
    def writes_16bit(self):
        """Whether the inner optimizer writes the targets in its own pass (``fp16_param_groups``)."""
        return self._fused_copy

    @property
    def fuses_clip(self):
        """Whether :meth:`step` and :meth:`step_and_gather` apply a clipping coefficient themselves (no pass)."""
        return self.pipeline is not None

    def finish(self):
        """Complete a pipelined step still running (a no-op otherwise)."""
        if self.pipeline is not None:
            self.pipeline.finish()

    def wait_for_piece(self, index):
        """Before a forward reads the parameters of piece ``index`` (and of the pieces before it)."""
        if self.pipeline is not None and self.pipeline.pending:
            self.pipeline.wait_through(index)

    def close(self):
        try:
            if self.pipeline is not None:
                self.pipeline.close()
        finally:
            if self.swap is not None:
                self.swap.close()
                self.swap = None

    def _target_groups(self, optimizer):
        return [[self.targets[g]] if group["params"] else [] for g, group in enumerate(optimizer.param_groups)]

    def wait_readers(self, extra=None):
        """Block until no asynchronous copy reads the targets (``extra``: another copy handle to wait for)."""
        self.finish()
        if self.share is not None:
            self.share.wait_host()
        self._reading.synchronize()
        self._reading = DONE
        if extra is not None:
            extra.synchronize()

    @torch.no_grad()
    def step(self, before_write=None, optimizer=None, threads_n=None, grad_scale=1.0):
        """One step of the inner optimizer on the host masters; the targets then hold their 16-bit values.

        ``before_write`` (a handle with ``synchronize()``) is waited for before the targets are written:
        copies from the targets that are not this object's own (ZeRO-3 parameter fetches). ``optimizer``
        steps instead of the inner one (a snapshot of it: same parameters and state); ``threads_n`` is the
        thread count of the calling thread for this step (default: ``self.threads``). ``grad_scale`` (the
        clipping coefficient, only where :attr:`fuses_clip`) multiplies the gradients as they are read.
        """
        optimizer = optimizer or self.optimizer
        self.wait_readers(before_write)
        if self.pipeline is not None and optimizer is self.optimizer:
            pieces = [
                StepPiece(g, lo, hi - lo, on_device=dev) for g, numel in enumerate(self.group_numel)
                for lo, hi, dev in self._device_pieces(g, 0, numel)
            ]
            with ds_range("DS::host_step"):
                self.pipeline.launch(pieces, grad_scale)
            self.fresh = True
            return
        if grad_scale != 1.0:
            raise ValueError("HostStep.step: a gradient scale needs the pipelined step (fuses_clip)")
        on_disk = self.swap is not None or (self.shard_tier is not None and not self.shard_tier.resident)
        if on_disk and optimizer is self.optimizer:  # the state or the targets on disk: stepped range by range
            with ds_range("DS::host_step"), threads(threads_n or self.threads):
                self._paged.run(optimizer)
            self.fresh = True
            return
        if self.swap is not None:  # another optimizer (a snapshot) steps the whole partition: the host tensors
            self.swap.swap_in()
        with ds_range("DS::host_step"), threads(threads_n or self.threads):
            if self._fused_copy:
                optimizer.step(fp16_param_groups=self._target_groups(optimizer))
            else:
                optimizer.step()
                self._cast_into_targets()
        self.fresh = True

    @torch.no_grad()
    def step_and_gather(self, layout, flat_params, group, grad_scale=1.0, background=False, begun=None):
        """Stages 1/2, pipelined (needs :attr:`pipeline`): step each bucket's piece in the order the forward needs
        them (last bucket first), upload it and all-gather it as soon as it is stepped.

        ``begun`` (``(prepared, stepped)``: the step's counted scalars and the ``(group, start)`` of pieces already
        stepped, a speculative step's that the verdict kept) continues that step: those pieces are only sent.

        With ``background`` (one rank only: a collective must not be issued from the worker thread) the call
        returns at once; :meth:`wait_for_piece` and :meth:`finish` wait. Piece ``i`` is bucket
        ``len(layout.buckets) - 1 - i``.
        """
        if background and layout.world_size != 1:
            raise ValueError("HostStep.step_and_gather: background steps need a world of one")
        self.wait_readers()
        group_of = group if callable(group) else (lambda bucket: group)
        transfers = self.transfers
        transfers.after_current()  # the uploads overwrite parameters the last backward read
        pieces = []
        for bucket in reversed(layout.buckets):
            out = layout.bucket_full(flat_params, bucket)
            if bucket.world == 1:

                def send(target, out=out):
                    return transfers.copy(out, target, wait_producer=False)
            else:

                def send(target, out=out, chunk=bucket.chunk, group=group_of(bucket)):
                    buffer = torch.empty(chunk, dtype=flat_params.dtype, device=flat_params.device)
                    copied = transfers.copy(buffer, target, wait_producer=False)
                    with copied.ordered():
                        return _Gathered(dist.all_gather_into_tensor(out, buffer, group=group, async_op=True))

            for lo, hi, dev in self._device_pieces(bucket.group, bucket.part_offset, bucket.chunk):
                if (lo, hi) != (bucket.part_offset, bucket.part_offset + bucket.chunk):
                    raise ValueError("HostStep.step_and_gather: a device range must hold whole buckets")
                pieces.append(StepPiece(bucket.group, lo, hi - lo, send, on_device=dev))
        self._launch(pieces, grad_scale, background, begun)

    def _launch(self, pieces, grad_scale, background, begun):
        """Launch ``pieces`` on the pipeline; ``begun`` as :meth:`step_and_gather` takes it."""
        prepared, stepped = begun if begun is not None else (None, ())
        stepped = [i for i, piece in enumerate(pieces) if (piece.group, piece.start) in stepped]
        with ds_range("DS::host_step"):
            self.pipeline.launch(pieces, grad_scale, background=background, prepared=prepared, stepped=stepped)
        self._reading = _StreamDone(self.transfers)
        self.fresh = False

    @torch.no_grad()
    def step_spans(self, spans, send_for=None, grad_scale=1.0, background=False, before_write=None, begun=None):
        """Pipelined (needs :attr:`pipeline`): step ``spans`` in the order given, each sent on when stepped.

        ``spans`` are ``(group, start, length)`` runs of the partitions that together cover every stepped group
        once (ZeRO-3: a unit's segment of a group, in the next forward's gather order); a span is cut where a
        device range begins or ends. ``send_for(group, start, length, on_device)`` returns a piece's ``send``
        (or None: nothing to send, the host wait is enough). ``before_write`` is waited for before the targets
        are written (as in :meth:`step`). With ``background`` the call returns at once (no collective is issued
        by a piece); :meth:`wait_for_piece` and :meth:`finish` wait. ``begun`` continues a step begun earlier, as
        in :meth:`step_and_gather`. Returns, per span, the index of its last piece (what :meth:`wait_for_piece`
        takes before the span's values are read).
        """
        self.wait_readers(before_write)
        self.transfers.after_current()  # the sends overwrite what the compute stream may still read
        pieces, last = [], []
        for g, start, length in spans:
            for lo, hi, dev in self._device_pieces(g, start, length):
                send = send_for(g, lo, hi - lo, dev) if send_for is not None else None
                pieces.append(StepPiece(g, lo, hi - lo, send, on_device=dev))
            last.append(len(pieces) - 1)
        self._launch(pieces, grad_scale, background, begun)
        return last

    @torch.no_grad()
    def refresh(self, before_write=None):
        """Recompute the targets from the masters (they changed outside a step)."""
        self.sync_host()
        if self.share is not None:
            self.share.mark_host_changed()
        self.wait_readers(before_write)
        with threads(self.threads):
            self._cast_into_targets()
        self.fresh = True

    def _cast_into_targets(self):
        for master, target in zip(self.masters, self.targets):
            numel = master.numel()
            for start in range(0, numel, CAST_CHUNK):
                length = min(CAST_CHUNK, numel - start)
                grad_ops.cast_copy([target.narrow(0, start, length)], [master.data.narrow(0, start, length)])

    # ----------------------------------------------------------------- uploads
    def upload(self, dsts):
        """Copy each target into ``dsts[g]`` (device tensors of its shape) on the side stream; the compute stream
        waits for them on the device."""
        if not self.fresh:
            self.refresh()
        self.fresh = False
        with ds_range("DS::upload"):
            last = self.transfers.copy_many([(dst, src) for dst, src in zip(dsts, self.targets) if dst is not None])
        self._reading = last
        last.wait_stream()

    @torch.no_grad()
    def upload_own(self, layout, flat_params):
        """Copy this rank's chunk of every bucket into its place in the flat 16-bit parameters (no collective); the
        compute stream waits for the copies."""
        if not self.fresh:
            self.refresh()
        self.fresh = False
        with ds_range("DS::upload"):
            last = self.transfers.copy_many([(layout.bucket_own_chunk_full(flat_params, bucket),
                                              layout.bucket_part(self.targets[bucket.group], bucket))
                                             for bucket in layout.buckets])
        self._reading = last
        last.wait_stream()

    @torch.no_grad()
    def gather_into(self, layout, flat_params, group):
        """Stages 1/2: put every rank's updated partition into the flat 16-bit parameters (a collective).

        Bucket by bucket: this rank's chunk is uploaded on the side stream, and the bucket's all-gather
        is launched behind that copy on the same stream, so the next bucket's upload overlaps it; the
        compute stream waits for the last of them.
        """
        if not self.fresh:
            self.refresh()
        self.fresh = False
        group_of = group if callable(group) else (lambda bucket: group)
        works = []
        last = DONE
        with ds_range("DS::upload_all_gather"):
            for bucket in layout.buckets:
                src = layout.bucket_part(self.targets[bucket.group], bucket)
                out = layout.bucket_full(flat_params, bucket)
                if bucket.world == 1:
                    last = self.transfers.copy(out, src)
                    continue
                send = torch.empty(bucket.chunk, dtype=flat_params.dtype, device=flat_params.device)
                last = self.transfers.copy(send, src)
                with last.ordered():
                    works.append(dist.all_gather_into_tensor(out, send, group=group_of(bucket), async_op=True))
            self._reading = last
            last.wait_stream()
            for work in works:
                work.wait()


class _Gathered:
    """A piece's all-gather as a handle the compute stream waits for."""

    __slots__ = ("work", )

    def __init__(self, work):
        self.work = work

    def wait_stream(self, stream=None):
        self.work.wait()


class _StreamDone:
    """Every copy issued on a transfer stream so far, as a handle the host waits for."""

    __slots__ = ("transfers", )

    def __init__(self, transfers):
        self.transfers = transfers

    def synchronize(self):
        self.transfers.synchronize()
