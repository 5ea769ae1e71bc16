# SPDX-License-Identifier: Apache-2.0
"""The collectives of the gradient pipeline and the ZeRO stages, behind one small interface.

A :class:`Transport` starts a collective and returns its work handle (``None`` when the
collective completed at once, as on a world of one). The pipeline waits on the handle
before it reads the output. Every call is asynchronous on the caller's side: on NCCL a
wait only orders the compute stream after the collective, it does not block the host.

The default, :class:`CommTransport`, sends everything through ``deepspeed.comm`` (so the
comms logger sees it). A quantized or hierarchical reduction plugs in by implementing
the three methods (ZeRO++'s qgZ: ``quantized_reduce.py``); a stage takes its transport at
construction.
"""

import deepspeed.comm as dist


class Transport:
    """The three collectives the pipeline needs (see the module docstring)."""

    def all_reduce(self, tensor, group):
        """Start a sum all-reduce of ``tensor`` in place; return its work handle or None."""
        raise NotImplementedError

    def reduce_scatter(self, output, input, group):
        """Start a sum reduce-scatter of ``input`` (``W`` equal chunks) into ``output`` (one chunk)."""
        raise NotImplementedError

    def all_gather(self, output, input, group):
        """Start an all-gather of every rank's ``input`` into ``output`` (``W`` chunks, rank order)."""
        raise NotImplementedError


class CommTransport(Transport):
    """The default transport: asynchronous ``deepspeed.comm`` collectives.

    ``label`` (optional) names what the collectives carry for the comms logger: they are recorded as
    ``"<collective>:<label>"`` (``all_gather_into_tensor:hpz_node``), so bytes can be told apart by use.
    """

    def __init__(self, label=None):
        self.label = label

    def _log(self, op):
        """The comms logger's name for ``op`` as keyword arguments (none without a label)."""
        return {} if self.label is None else {"log_name": f"{op}:{self.label}"}

    def all_reduce(self, tensor, group):
        return dist.all_reduce(tensor, group=group, async_op=True, **self._log("all_reduce"))

    def reduce_scatter(self, output, input, group):
        return dist.reduce_scatter_tensor(output,
                                          input,
                                          group=group,
                                          async_op=True,
                                          **self._log("reduce_scatter_tensor"))

    def all_gather(self, output, input, group):
        return dist.all_gather_into_tensor(output,
                                           input,
                                           group=group,
                                           async_op=True,
                                           **self._log("all_gather_into_tensor"))


DEFAULT_TRANSPORT = CommTransport()


class GroupTransports(Transport):
    """Each group's collectives through a transport of its own: ``routes`` is ``[(group, transport)]``, a group
    matched by identity; every other group goes through ``default``. (ZeRO-3 with qgZ: the dense group's and
    each expert-data-parallel group's quantized reduce-scatter, each with its own size and node axis.)"""

    def __init__(self, default, routes):
        self.default = default
        self.routes = list(routes)

    def of(self, group):
        return next((t for g, t in self.routes if g is group), self.default)

    def all_reduce(self, tensor, group):
        return self.of(group).all_reduce(tensor, group)

    def reduce_scatter(self, output, input, group):
        return self.of(group).reduce_scatter(output, input, group)

    def all_gather(self, output, input, group):
        return self.of(group).all_gather(output, input, group)


def wait(work):
    """Complete ``work`` (a handle a transport returned, or None)."""
    if work is not None:
        work.wait()
