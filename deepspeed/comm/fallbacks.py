# SPDX-License-Identifier: Apache-2.0
"""What each process group's backend can do, and equivalent collectives where it cannot.

Some backends lack a collective (older gloo builds have no reduce-scatter and no
all-gather into one tensor, and gloo has no ``ReduceOp.AVG``). ``comm.py`` calls
the native collective first; when the backend refuses it, the refusal is
recorded in the group's :class:`GroupCapabilities` and this and every later call
on that group takes the equivalent path here:

* ``AVG``                    -> ``SUM``, then divide by the group size;
* ``reduce_scatter_tensor``  -> ``all_reduce`` of a copy, then copy this rank's chunk;
* ``reduce_scatter``         -> ``all_reduce`` of the concatenated inputs, then copy this rank's piece;
* ``all_gather_into_tensor`` -> ``all_gather`` into views of the output's chunks.

A backend refuses before it communicates (the check is made when the work is
enqueued), so every rank learns the same thing at the same call and the ranks
stay in step. With ``async_op=True`` a fallback returns a :class:`ChainedWork`
whose ``wait()`` waits for the collective and then runs the local completion
step; the output is valid only after ``wait()``.
"""

import torch
import torch.distributed as dist

# Native collectives, preferring the names that newer torch releases do not deprecate.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

COLLECTIVE_ERRORS = (RuntimeError, ValueError, NotImplementedError)


class GroupCapabilities:
    """Which native collectives one process group's backend accepts (learned on first refusal)."""

    __slots__ = ("avg", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor")

    def __init__(self):
        self.avg = True
        self.reduce_scatter_tensor = True
        self.reduce_scatter = True
        self.all_gather_into_tensor = True

    def learn(self, err, collective):
        """Record that ``collective`` (or AVG) is unsupported if ``err`` says so; False if it is a real failure."""
        message = str(err)
        if "ReduceOp.AVG" in message and self.avg:
            self.avg = False
            return True
        if "not support" in message and collective in self.__slots__ and getattr(self, collective):
            setattr(self, collective, False)
            return True
        return False


_CAPABILITIES = {}


def capabilities(group):
    """The (cached) capabilities of ``group``; ``None`` stands for the default group."""
    caps = _CAPABILITIES.get(group)
    if caps is None:
        caps = _CAPABILITIES[group] = GroupCapabilities()
    return caps


def reset_capabilities():
    """Forget every group (their backends change when process groups are destroyed and re-created)."""
    _CAPABILITIES.clear()


class ChainedWork:
    """A work handle for collectives followed by a local completion step.

    ``wait()`` waits for every underlying work, then runs ``then`` once; it is
    idempotent. ``get_future()`` waits, then returns a completed future holding
    ``result`` (the output tensors).
    """

    __slots__ = ("_works", "_then", "_result")

    def __init__(self, works, then, result):
        self._works = [w for w in works if w is not None]
        self._then = then
        self._result = result

    def wait(self, timeout=None):
        works, self._works = self._works, []
        for work in works:
            work.wait()
        then, self._then = self._then, None
        if then is not None:
            then()
        return True

    def synchronize(self):
        self.wait()

    def is_completed(self):
        if all(work.is_completed() for work in self._works):
            self.wait()
            return True
        return False

    def is_success(self):
        return self.is_completed()

    def exception(self):
        return None

    def get_future(self):
        self.wait()
        future = torch.futures.Future()
        future.set_result(self._result)
        return future


def _finish(works, then, result, async_op):
    if async_op:
        return ChainedWork(works, then, result)
    if then is not None:
        then()
    return None


def _avg_as_sum(caps, op, group):
    """(op to issue, divisor to apply afterwards or None)."""
    if not caps.avg and op == dist.ReduceOp.AVG:
        return dist.ReduceOp.SUM, dist.get_world_size(group)
    return op, None


def _divide(tensor, divisor):
    if divisor is None:
        return None
    return lambda: tensor.div_(divisor)


def all_reduce(caps, tensor, op, group, async_op):
    op, divisor = _avg_as_sum(caps, op, group)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return _finish([work], _divide(tensor, divisor), [tensor], async_op)


def reduce(caps, tensor, dst, op, group, async_op):
    op, divisor = _avg_as_sum(caps, op, group)
    work = dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)
    is_dst = dist.get_rank() == dst
    return _finish([work], _divide(tensor, divisor) if is_dst else None, [tensor], async_op)


def reduce_scatter_tensor(caps, output, input, op, group, async_op):
    op, divisor = _avg_as_sum(caps, op, group)
    if caps.reduce_scatter_tensor:
        try:
            work = reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
            return _finish([work], _divide(output, divisor), [output], async_op)
        except COLLECTIVE_ERRORS as err:
            if not caps.learn(err, "reduce_scatter_tensor"):
                raise

    world_size = dist.get_world_size(group)
    if input.numel() != world_size * output.numel():
        raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, expected "
                         f"{world_size} x {output.numel()} (world size x output)")
    start = dist.get_rank(group) * output.numel()
    reduced = input.clone(memory_format=torch.contiguous_format)
    work = dist.all_reduce(reduced, op=op, group=group, async_op=async_op)

    def then():
        output.copy_(reduced.view(-1)[start:start + output.numel()].view_as(output))
        if divisor is not None:
            output.div_(divisor)

    return _finish([work], then, [output], async_op)


def reduce_scatter(caps, output, input_list, op, group, async_op):
    op, divisor = _avg_as_sum(caps, op, group)
    if caps.reduce_scatter:
        try:
            work = dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
            return _finish([work], _divide(output, divisor), [output], async_op)
        except COLLECTIVE_ERRORS as err:
            if not caps.learn(err, "reduce_scatter"):
                raise

    rank = dist.get_rank(group)
    start = sum(t.numel() for t in input_list[:rank])
    reduced = torch.cat([t.reshape(-1) for t in input_list])
    work = dist.all_reduce(reduced, op=op, group=group, async_op=async_op)

    def then():
        output.copy_(reduced[start:start + output.numel()].view_as(output))
        if divisor is not None:
            output.div_(divisor)

    return _finish([work], then, [output], async_op)


def all_gather_into_tensor(caps, output, input, group, async_op):
    world_size = dist.get_world_size(group)
    if output.numel() != world_size * input.numel():
        raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, expected "
                         f"{world_size} x {input.numel()} (world size x input)")
    if not output.is_contiguous():
        raise ValueError("all_gather_into_tensor: the output tensor must be contiguous")
    chunks = [chunk.view(input.shape) for chunk in output.view(-1).chunk(world_size)]
    work = dist.all_gather(chunks, input, group=group, async_op=async_op)
    return _finish([work], None, [output], async_op)


def all_reduce_coalesced(caps, tensors, op, group, async_op):
    """One ``all_reduce`` per (device, dtype) over a flattened copy, results copied back into ``tensors``."""
    op, divisor = _avg_as_sum(caps, op, group)
    buckets = {}
    for tensor in tensors:
        buckets.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    works, copies = [], []
    for bucket in buckets.values():
        flat = torch.cat([t.reshape(-1) for t in bucket])
        works.append(dist.all_reduce(flat, op=op, group=group, async_op=async_op))
        copies.append((flat, bucket))

    def then():
        for flat, bucket in copies:
            offset = 0
            for tensor in bucket:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
                if divisor is not None:
                    tensor.div_(divisor)

    return _finish(works, then, list(tensors), async_op)
