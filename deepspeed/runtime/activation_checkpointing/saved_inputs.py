# SPDX-License-Identifier: Apache-2.0
"""Where a checkpointed layer's inputs wait between its forward and its backward: the memory options of
``deepspeed.checkpointing`` (``cpu_checkpointing``, ``partition_activations``, ``contiguous_memory_optimization``,
``number_checkpoints``).

A checkpoint keeps only its inputs; :class:`InputStore` decides how. ``pack(tensor)`` is called once per input in
the forward and returns what the checkpoint holds instead of the input; ``unpack(held)`` gives back a tensor of the
input's values, size, strides, dtype and device in the backward (as often as the backward asks: a retained graph
unpacks again). The values are the input's bit for bit, so recomputation and gradients are those of a checkpoint
that kept the input itself. Only floating tensors that are not parameters are stored differently; every other
input is held as it is.

* ``partition`` (``partition_activations`` with a model-parallel group of size ``m`` > 1): each model-parallel rank
  keeps one ``1/m`` piece of the flattened input (padded to a multiple of ``m``); unpacking all-gathers the pieces
  over the group. The contract, as upstream's: the input is the same on every rank of the group (a tensor-parallel
  layer's replicated input), and every rank of the group runs the same backward.
* ``contiguous`` (``contiguous_memory_optimization``, with ``partition``): the pieces of the ``i``-th input of
  successive checkpoints are written into one block allocated for ``number_checkpoints`` of them, instead of a
  tensor each (less fragmentation). A forward with more checkpoints than that raises; the first backward starts new
  blocks for the next forward (the held pieces keep theirs alive).
* ``cpu`` (``cpu_checkpointing``): what is kept (the input, or its piece) goes to host memory. Alone, it is
  asynchronous: the newest ``keep_last`` inputs stay on the device (the backward needs them first); an older one
  is copied to a pinned, pooled host buffer on a side stream that waits for the compute stream, and its device
  memory goes back to the allocator once the copy is done (``record_stream``), so the copy overlaps the next
  layers' forward. In the backward, unpacking input ``k`` also starts the copy back of input ``k - 1`` on the side
  stream, so it overlaps layer ``k``'s recomputation; the compute stream waits for a copy back only where it uses
  the input. With ``partition``, the piece is copied to the host and back as upstream does, in order.

An input already in host memory is not copied (:func:`needs_offload`: there is no device memory to free).
"""

import weakref
from dataclasses import dataclass

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator


@dataclass
class InputStoreStats:
    """What a store did since it was built or reset."""
    packed: int = 0  # inputs stored differently (offloaded or partitioned)
    offloaded: int = 0
    offloaded_bytes: int = 0
    restored: int = 0
    prefetched: int = 0
    partitioned: int = 0
    kept_numel: int = 0  # elements a partitioned input keeps on this rank (its piece)


def needs_offload(tensor):
    """Whether ``cpu_checkpointing`` moves ``tensor``: one in device memory (a host tensor is left where it is)."""
    return tensor.device.type not in ("cpu", "meta")


def _stored(tensor):
    return (torch.is_tensor(tensor) and tensor.is_floating_point() and not isinstance(tensor, torch.nn.Parameter)
            and tensor.numel() > 0)


def _dense(tensor):
    """Whether ``tensor`` covers its elements once each (it can be rebuilt from a flat copy with its strides)."""
    return not any(stride == 0 and size > 1 for size, stride in zip(tensor.size(), tensor.stride()))


def _like(flat, size, stride, device):
    """A tensor of ``size`` and ``stride`` on ``device`` holding ``flat``'s values in logical order."""
    out = torch.empty_strided(size, stride, dtype=flat.dtype, device=device)
    out.copy_(flat.view(size))
    return out


def _record_stream(tensor, stream):
    """Tell the allocator that ``stream`` uses ``tensor`` (a device tensor; host memory has no streams)."""
    if tensor.device.type != "cpu":
        tensor.record_stream(stream)


class _Offloaded:
    """A checkpoint input on its way to, or in, host memory (``cpu_checkpointing`` alone)."""

    __slots__ = ("store", "tensor", "host", "event", "size", "stride", "device", "index", "prefetched", "__weakref__")

    def __init__(self, store, tensor, index):
        self.store = store
        self.tensor = tensor  # the device tensor until its copy is started
        self.host = None
        self.event = None  # the copy to the host, recorded on the side stream
        self.size, self.stride, self.device = tensor.size(), tensor.stride(), tensor.device
        self.index = index
        self.prefetched = None  # (device tensor, event) of a copy back started ahead of the unpack


class _Partitioned:
    """This rank's piece of a checkpoint input (``partition_activations``)."""

    __slots__ = ("piece", "size", "stride", "numel", "device", "dtype")

    def __init__(self, piece, tensor):
        self.piece = piece
        self.size, self.stride, self.numel = tensor.size(), tensor.stride(), tensor.numel()
        self.device, self.dtype = tensor.device, tensor.dtype


class InputStore:
    """The policy above, for one set of options (see the module docstring)."""

    def __init__(self, *, cpu=False, group=None, contiguous=False, num_checkpoints=None, keep_last=1):
        self.cpu = bool(cpu)
        self.group = group
        self.parts = dist.get_world_size(group) if group is not None else 1
        self.part_rank = dist.get_rank(group) if group is not None else 0
        self.partition = self.parts > 1
        self.contiguous = bool(contiguous) and self.partition
        self.num_checkpoints = num_checkpoints
        self.keep_last = int(keep_last)
        self.stats = InputStoreStats()
        # the side stream of the asynchronous copies (cpu_checkpointing alone, an accelerator with streams), made on
        # first use so that it belongs to the device the inputs are on
        self._streams = self.cpu and not self.partition and not get_accelerator().is_synchronized_device()
        self._stream = None
        self._pool = {}  # (numel, dtype) -> free host buffers
        self._returning = []  # (key, buffer, event): buffers whose last copy back may still read them
        self._kept = []  # handles still on the device, oldest first (at most keep_last)
        self._order = []  # weak references to this forward's offloaded handles, in forward order
        self._count = 0
        self._blocks = {}  # contiguous: input position -> [block, next slot]
        self._position = 0  # position of the next input within the current checkpoint
        self._expected = 0  # tensor inputs of the current checkpoint

    # ------------------------------------------------------------ what a checkpoint calls
    @property
    def active(self):
        """Whether any input is stored differently from keeping it."""
        return self.cpu or self.partition

    def begin_checkpoint(self, count):
        """A checkpoint's forward is about to save its ``count`` tensor inputs (their positions restart at 0; what
        is saved after them, by the layer itself, is held as it is)."""
        self._position = 0
        self._expected = count

    def pack(self, tensor):
        position = self._position
        self._position += 1
        if position >= self._expected or not _stored(tensor):
            return tensor
        if self.partition and tensor.numel() >= self.parts and _dense(tensor):
            return self._pack_piece(tensor, position)
        if self.cpu and needs_offload(tensor) and _dense(tensor):
            return self._pack_offload(tensor)
        return tensor

    def unpack(self, held):
        if isinstance(held, _Offloaded):
            return self._restore(held)
        if isinstance(held, _Partitioned):
            return self._gather(held)
        return held

    def reset(self):
        """Forget the contiguous blocks and the forward order (between evaluation forwards); copies in flight
        complete first. Inputs already held stay valid."""
        if self._stream is not None:
            self._stream.synchronize()
        self._blocks = {}
        self._kept = []
        self._order = []
        self._reap(wait=True)

    # ------------------------------------------------------------ partition_activations
    def _pack_piece(self, tensor, position):
        chunk = -(-tensor.numel() // self.parts)
        flat = tensor.detach().reshape(-1)
        start = min(self.part_rank * chunk, flat.numel())
        own = flat.narrow(0, start, min(chunk, flat.numel() - start))
        if self.contiguous:
            piece = self._block_slot(position, chunk, tensor)
        else:
            piece = torch.empty(chunk, dtype=tensor.dtype, device="cpu" if self.cpu else tensor.device)
        piece.narrow(0, 0, own.numel()).copy_(own)
        if own.numel() < chunk:
            piece.narrow(0, own.numel(), chunk - own.numel()).zero_()
        self.stats.packed += 1
        self.stats.partitioned += 1
        self.stats.kept_numel += chunk
        return _Partitioned(piece, tensor)

    def _block_slot(self, position, chunk, tensor):
        if self.num_checkpoints is None:
            raise ValueError("activation_checkpointing.contiguous_memory_optimization needs number_checkpoints")
        entry = self._blocks.get(position)
        if entry is None:
            device = "cpu" if self.cpu else tensor.device
            block = torch.empty(int(self.num_checkpoints), chunk, dtype=tensor.dtype, device=device)
            entry = self._blocks[position] = [block, 0]
        block, slot = entry
        if block.size(1) != chunk or block.dtype != tensor.dtype:
            raise ValueError(f"activation_checkpointing.contiguous_memory_optimization needs checkpoints whose input "
                             f"{position} has one size and dtype; got {tuple(tensor.size())} {tensor.dtype} after "
                             f"pieces of {block.size(1)} {block.dtype}")
        if slot >= block.size(0):
            raise ValueError(f"activation_checkpointing.number_checkpoints is {self.num_checkpoints}, but this "
                             "forward ran more checkpoints before a backward")
        entry[1] = slot + 1
        return block[slot]

    def _gather(self, held):
        self._blocks = {}  # the backward began: the next forward writes new blocks
        piece = held.piece.to(held.device, non_blocking=False)
        full = torch.empty(piece.numel() * self.parts, dtype=held.dtype, device=held.device)
        dist.all_gather_into_tensor(full, piece, group=self.group)
        self.stats.restored += 1
        return _like(full.narrow(0, 0, held.numel), held.size, held.stride, held.device)

    # ------------------------------------------------------------ cpu_checkpointing
    def _pack_offload(self, tensor):
        self._count += 1
        handle = _Offloaded(self, tensor.detach(), self._count)
        self._order = [ref for ref in self._order if ref() is not None]
        self._order.append(weakref.ref(handle))
        self._kept.append(weakref.ref(handle))
        while len(self._kept) > self.keep_last:
            older = self._kept.pop(0)()
            if older is not None and older.tensor is not None:
                self._start_offload(older)
        self.stats.packed += 1
        return handle

    def _host_buffer(self, numel, dtype):
        self._reap()
        free = self._pool.get((numel, dtype))
        if free:
            return free.pop()
        buffer = torch.empty(numel, dtype=dtype, device="cpu")
        if self._stream is not None:
            buffer = get_accelerator().pin_memory(buffer)
        return buffer

    def _side_stream(self, device):
        if self._streams and self._stream is None:
            self._stream = get_accelerator().Stream(device=device)
        return self._stream

    def _compute_stream(self, device):
        return get_accelerator().current_stream(device.index)

    def _start_offload(self, handle):
        tensor = handle.tensor
        self._side_stream(tensor.device)
        host = self._host_buffer(tensor.numel(), tensor.dtype)
        accelerator = get_accelerator()
        if self._stream is not None:
            self._stream.wait_stream(self._compute_stream(tensor.device))
            with accelerator.stream(self._stream):
                host.view(tensor.size()).copy_(tensor, non_blocking=True)
                handle.event = accelerator.Event()
                handle.event.record(self._stream)
            _record_stream(tensor, self._stream)  # its memory is reused only after the copy
        else:
            host.view(tensor.size()).copy_(tensor)
        handle.host = host
        handle.tensor = None
        weakref.finalize(handle, self._give_back, host)
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += tensor.numel() * tensor.element_size()

    def _give_back(self, host):
        """A handle is gone: its host buffer returns to the pool once no copy reads it (the last copy back's event is
        the side stream's state when it is returned; the side stream is in order)."""
        event = None
        if self._stream is not None:
            event = get_accelerator().Event()
            event.record(self._stream)
        self._returning.append(((host.numel(), host.dtype), host, event))

    def _reap(self, wait=False):
        pending = []
        for key, buffer, event in self._returning:
            if event is not None and not wait and not event.query():
                pending.append((key, buffer, event))
                continue
            if event is not None:
                event.synchronize()
            self._pool.setdefault(key, []).append(buffer)
        self._returning = pending

    def _copy_back(self, handle):
        """Start the copy of ``handle``'s host buffer to a new device tensor; ``(tensor, event or None)``."""
        accelerator = get_accelerator()
        out = torch.empty_strided(handle.size, handle.stride, dtype=handle.host.dtype, device=handle.device)
        if self._stream is None:
            out.copy_(handle.host.view(handle.size))
            return out, None
        self._stream.wait_stream(self._compute_stream(handle.device))  # ``out``'s memory may have been in use
        with accelerator.stream(self._stream):
            out.copy_(handle.host.view(handle.size), non_blocking=True)
            event = accelerator.Event()
            event.record(self._stream)
        _record_stream(out, self._stream)
        return out, event

    def _restore(self, handle):
        if handle.tensor is not None:  # still on the device (one of the last inputs)
            self._prefetch_before(handle)
            return handle.tensor
        if handle.prefetched is not None:
            out, event = handle.prefetched
            handle.prefetched = None
        else:
            out, event = self._copy_back(handle)
        if event is not None:
            self._compute_stream(handle.device).wait_event(event)
        self.stats.restored += 1
        self._prefetch_before(handle)
        return out

    def _prefetch_before(self, handle):
        """Start the copy back of the input offloaded just before ``handle`` (the next one the backward needs)."""
        if self._stream is None:
            return
        previous = None
        for ref in self._order:
            other = ref()
            if other is None or other.index >= handle.index:
                continue
            if previous is None or other.index > previous.index:
                previous = other
        if previous is not None and previous.tensor is None and previous.prefetched is None:
            previous.prefetched = self._copy_back(previous)
            self.stats.prefetched += 1
