# SPDX-License-Identifier: Apache-2.0
"""Transfers between pipeline stages: upstream's ``send``/``recv`` and the engine's self-describing exchanges.

Upstream's surface (``init_process_groups``, ``send``, ``recv``, ``send_obj``, ``recv_obj``, ``wait``) moves one
tensor, blocking, between adjacent stages (or the first and the last) of this rank's pipeline.

The engine moves tuples of tensors with :class:`Exchange`: every transfer of activations is preceded by a
*header* (the dtype, ``requires_grad`` and shape of every tensor), and every receive allocates fresh tensors
of exactly the announced dtypes and shapes, so nothing is ever received into a buffer of another dtype or
size. Gradients travel back without a header: both sides know them from the activation header (one
gradient per tensor that required grad, its dtype and shape). Without ``dynamic_shape`` the first header
of each stream is kept, and a later one whose tensors differ in count, dtype or shape raises
:class:`PipelineShapeError` on both ends (after the headers are exchanged, before any payload is), instead of
computing on data of another shape; ``requires_grad`` may differ (evaluation and training share the streams).

An exchange posts all its sends and receives together: with NCCL as one ``batch_isend_irecv`` on the pipeline's
own group (two stages may send to each other in the same exchange). With gloo each transfer is a broadcast in the
two-rank group of its stages, in an order both ends derive alike (the sender's rank, then the instructions'
order): gloo's point-to-point waits cannot be resumed after a timeout, its collectives can, so waits stay
watched for failed peers (docs/faults.md) and a stage whose neighbour failed raises in bounded time.
"""

import pickle

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import groups

_groups = None
_grid = None
_group = None  # the stages' transfer group (see init_process_groups)
_pairs = None  # gloo: (lower rank, higher rank) -> the two-rank group of neighbouring stages
_async = []

# dtype <-> id for headers: upstream's twelve first (their ids), then the newer ones this torch has.
ID_TO_DTYPE = [
    torch.float32, torch.float64, torch.complex64, torch.complex128, torch.float16, torch.bfloat16, torch.uint8,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.bool
] + [
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64") if hasattr(torch, name)
]
DTYPE_TO_ID = {dtype: i for i, dtype in enumerate(ID_TO_DTYPE)}
HEADER_INTS = 64  # a header fits in one message of this many int64 for up to ~12 tensors of 3 dims


class PipelineShapeError(RuntimeError):
    """An activation changed dtype or shape between micro-batches without ``dynamic_shape=True``."""


def can_send_recv() -> bool:
    return True


def init_process_groups(grid):
    """Set up transfers over ``grid``'s pipelines (a collective: every rank).

    Each pipeline's stages get a process group of their own for transfers (``groups.group_of_ranks``), so the
    point-to-point messages never share a communicator, nor its sequence of operations, with the collectives
    of the default group. Returns that group.
    """
    global _grid, _group, _pairs
    if grid.pipe_parallel_size <= 1:
        raise AssertionError("There is no pipeline parallelism")
    _grid = grid
    _group = groups.group_of_ranks(grid.pipe_groups, own=True)
    _pairs = None
    if dist.get_backend() == "gloo":
        _pairs = {}
        pairs = sorted({
            tuple(sorted((ranks[i], ranks[(i + 1) % len(ranks)])))
            for ranks in grid.pipe_groups
            for i in range(len(ranks))
        })
        for pair in pairs:
            group = groups.group_of_ranks([pair], own=True)
            if group is not None:
                _pairs[pair] = group
    return _group


def _is_valid_send_recv(src_stage, dest_stage):
    last = _grid.pipe_parallel_size - 1
    if not (abs(src_stage - dest_stage) == 1 or {src_stage, dest_stage} == {0, last}):
        raise AssertionError("Functionality currently limited to send and receive between adjacent ranks only")


def send(tensor, dest_stage, async_op=False):
    """Send ``tensor`` to stage ``dest_stage`` of this rank's pipeline (blocking)."""
    if async_op:
        raise AssertionError("Doesn't support async_op true")
    _is_valid_send_recv(_grid.get_stage_id(), dest_stage)
    _wait_all(post([("send", tensor, _grid.stage_to_global(stage_id=dest_stage))], _group))


def recv(tensor, src_stage, async_op=False):
    """Receive into ``tensor`` from stage ``src_stage`` of this rank's pipeline (blocking)."""
    if async_op:
        raise AssertionError("Doesn't support async_op true")
    _is_valid_send_recv(src_stage, _grid.get_stage_id())
    _wait_all(post([("recv", tensor, _grid.stage_to_global(stage_id=src_stage))], _group))


def wait():
    global _async
    _wait_all(_async)
    _async = []
    get_accelerator().synchronize()


def _device():
    name = get_accelerator().device_name()
    return torch.device("cpu") if dist.get_backend() == "gloo" else torch.device(name)


def send_obj(msg, dest):
    """Send a picklable object to global rank ``dest`` (two messages: its length, then its bytes)."""
    data = pickle.dumps(msg)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(_device())
    length = torch.tensor([len(data)], dtype=torch.long, device=_device())
    dist.send(length, dest)
    dist.send(payload, dest)


def recv_obj(sender):
    """Receive an object sent with :func:`send_obj` by global rank ``sender``; its tensors move to this device."""
    length = torch.zeros(1, dtype=torch.long, device=_device())
    dist.recv(length, sender)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=_device())
    dist.recv(payload, sender)
    msg = pickle.loads(payload.cpu().numpy().tobytes())
    device = get_accelerator().device_name()

    def _to(x):
        if torch.is_tensor(x):
            return x.to(device)
        if isinstance(x, (tuple, list)):
            return type(x)(_to(v) for v in x)
        if isinstance(x, dict):
            return {_to(k): _to(v) for k, v in x.items()}
        return x

    return _to(msg)


def post(ops, group):
    """Start the transfers ``ops`` (``[(kind, tensor, peer global rank)]``, kind ``"send"``/``"recv"``); returns
    their work handles (see the module docstring for how, per backend)."""
    if _pairs is None:
        return dist.batch_isend_irecv(ops, group=group)
    me = dist.get_rank()
    works = []
    order = sorted(range(len(ops)),
                   key=lambda i: (min(me, ops[i][2]), max(me, ops[i][2]), me if ops[i][0] == "send" else ops[i][2], i))
    for i in order:
        kind, tensor, peer = ops[i]
        group = _pairs[(min(me, peer), max(me, peer))]
        works.append(dist.broadcast(tensor, me if kind == "send" else peer, group=group, async_op=True))
    return works


def _wait_all(works):
    for work in works:
        work.wait()


# ---------------------------------------------------------------------------------------- headers
def encode_header(tensors, is_tensor=False):
    """``[kind, n, (dtype id, requires_grad, ndim, *shape) per tensor]`` as ints (kind 0: one tensor, 2: a tuple)."""
    out = [0 if is_tensor else 2, len(tensors)]
    for t in tensors:
        if t.dtype not in DTYPE_TO_ID:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype} between pipeline stages")
        out += [DTYPE_TO_ID[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    return out


def decode_header(ints):
    """``[(dtype, requires_grad, shape)]`` from :func:`encode_header`'s ints."""
    n, pos, specs = int(ints[1]), 2, []
    for _ in range(n):
        dtype, requires_grad, ndim = ID_TO_DTYPE[int(ints[pos])], bool(ints[pos + 1]), int(ints[pos + 2])
        specs.append((dtype, requires_grad, tuple(int(v) for v in ints[pos + 3:pos + 3 + ndim])))
        pos += 3 + ndim
    return specs


def describe(specs):
    return "(" + ", ".join(f"{str(d).replace('torch.', '')}{list(s)}" for d, _, s in specs) + ")"


def _wire(tensor):
    """The tensor as it travels: contiguous, bools as bytes (NCCL has no bool)."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bool:
        tensor = tensor.view(torch.uint8)
    return tensor.contiguous()


class _Recv:
    """A receive of an :class:`Exchange`; ``tensors`` holds the result once the exchange is flushed."""

    __slots__ = ("src", "stream", "specs", "tensors", "header", "wire", "then")

    def __init__(self, src, stream, specs):
        self.src = src
        self.stream = stream
        self.specs = specs  # None: announced by a header
        self.tensors = None
        self.header = None
        self.wire = None
        self.then = None  # called with the received tensors

    @property
    def is_tensor(self):
        """Whether the sender sent one tensor (not a tuple), as its header says."""
        return self.header is not None and self.header[0] == 0


class _Send:

    __slots__ = ("dst", "stream", "tensors", "with_header", "header")

    def __init__(self, dst, stream, tensors, with_header, is_tensor):
        self.dst = dst
        self.stream = stream
        self.tensors = tensors
        self.with_header = with_header
        self.header = encode_header(tensors, is_tensor) if with_header else None


class Exchange:
    """A batch of sends and receives between stages, posted together by :meth:`flush` (module docstring).

    ``known_headers`` maps a stream (``(peer global rank, kind, chunk)``) to the header it must keep
    without ``dynamic_shape`` (None: shapes may change); it is filled on first use.
    """

    def __init__(self, device, known_headers, dynamic_shape, group=None):
        self.device = device
        self.group = group
        self.known = known_headers
        self.dynamic = dynamic_shape
        self.sends = []
        self.recvs = []

    def __bool__(self):
        return bool(self.sends or self.recvs)

    def send(self, tensors, dst, stream, with_header=True, is_tensor=False):
        self.sends.append(_Send(dst, stream, list(tensors), with_header, is_tensor))

    def recv(self, src, stream, specs=None):
        """Receive from global rank ``src``: tensors of ``specs`` (``[(dtype, requires_grad, shape)]``), or as
        announced by a header when ``specs`` is None. Returns the handle whose ``tensors`` :meth:`flush` fills."""
        op = _Recv(src, stream, specs)
        self.recvs.append(op)
        return op

    def flush(self):
        """Exchange headers, check them, then the payloads; afterwards every receive holds its tensors."""
        if not self:
            return
        ops = []
        for s in self.sends:
            if s.with_header:
                if len(s.header) > HEADER_INTS:
                    raise PipelineShapeError(f"an activation tuple {describe(decode_header(s.header))} needs a "
                                             f"header of {len(s.header)} ints, more than {HEADER_INTS}; send fewer "
                                             f"tensors or tensors of fewer dimensions between stages")
                wire = torch.zeros(HEADER_INTS, dtype=torch.int64, device=self.device)
                wire[:len(s.header)] = torch.tensor(s.header, dtype=torch.int64)
                ops.append(("send", wire, s.dst))
        for r in self.recvs:
            if r.specs is None:
                r.wire = torch.empty(HEADER_INTS, dtype=torch.int64, device=self.device)
                ops.append(("recv", r.wire, r.src))
        if ops:
            _wait_all(post(ops, self.group))
        for r in self.recvs:
            if r.specs is None:
                r.header = r.wire.cpu().tolist()
                r.specs = decode_header(r.header)
                r.wire = None
        self._check_shapes()
        ops = []
        for s in self.sends:
            ops += [("send", _wire(t), s.dst) for t in s.tensors]
        for r in self.recvs:
            r.tensors = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, _, shape in r.specs]
            ops += [("recv", t.view(torch.uint8) if t.dtype == torch.bool else t, r.src) for t in r.tensors]
        if ops:
            _wait_all(post(ops, self.group))
        recvs, self.sends, self.recvs = self.recvs, [], []
        for r in recvs:
            if r.then is not None:
                r.then(r.tensors)

    def _check_shapes(self):
        """Without ``dynamic_shape``: every header of a stream carries the tensors of its first one (raised on both
        ends). Only what the transfer's buffers depend on is compared: the number of tensors, their dtypes and
        shapes. ``requires_grad`` is not: it is False in ``eval_batch`` and True in ``train_batch`` for the same
        activations, and the receiver takes it from the header it just received."""
        if self.dynamic:
            return
        problems = []
        for op, role in [(s, "sends") for s in self.sends if s.with_header] + \
                [(r, "receives") for r in self.recvs if r.header is not None]:
            first = self.known.setdefault(op.stream, op.header)
            difference = header_difference(decode_header(first), decode_header(op.header))
            if difference:
                problems.append(f"this stage {role} {describe(decode_header(op.header))} where the first micro-batch "
                                f"had {describe(decode_header(first))}: {difference} (stream {op.stream})")
        if problems:
            raise PipelineShapeError(
                "pipeline activations changed shape or dtype without dynamic_shape: " + "; ".join(problems) +
                ". Build the PipelineModule with dynamic_shape=True, or call engine.reset_activation_shape() "
                "before a batch whose shapes differ (all micro-batches of one batch must then agree).")


def header_difference(first, now):
    """What differs between two decoded headers in what a transfer depends on (count, dtypes, shapes), in words;
    ``""`` when they agree."""
    if len(first) != len(now):
        return f"{len(now)} tensors instead of {len(first)}"
    out = []
    for i, ((dtype0, _, shape0), (dtype1, _, shape1)) in enumerate(zip(first, now)):
        if dtype0 != dtype1:
            out.append(f"tensor {i} dtype {str(dtype1).replace('torch.', '')} instead of "
                       f"{str(dtype0).replace('torch.', '')}")
        if shape0 != shape1:
            out.append(f"tensor {i} shape {list(shape1)} instead of {list(shape0)}")
    return ", ".join(out)
