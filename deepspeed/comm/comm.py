# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.comm``: a thin layer over torch.distributed.

Every collective takes torch.distributed's arguments and returns what it returns
(``None``, or a work handle with ``async_op=True``). The layer adds two things:

* ``init_distributed``, which finds the job description in the environment
  (torchrun, the ``deepspeed`` launcher, Open MPI, or a lone process) and picks
  the backend and device from the accelerator;
* equivalents for collectives a backend lacks (see ``fallbacks.py``), chosen per
  process group the first time the backend refuses one.

The collectives are on the training hot path: each costs one dict lookup and two
attribute tests on top of torch.distributed (one of them asks whether the comms
logger is on; see ``timed.py``), and logs nothing unless the comms logger is enabled.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from . import fallbacks, lifecycle, peer_failure
from .env import discover
from .fallbacks import COLLECTIVE_ERRORS, all_gather_single, reduce_scatter_single
from .reduce_op import ReduceOp
from .timed import comms_logger, timed_op

_CAPS = fallbacks._CAPABILITIES
_capabilities = fallbacks.capabilities
_AVG = ReduceOp.AVG
_AS_ALL_REDUCE = fallbacks.GroupCapabilities()  # gloo with watched waits: reduce-scatter as an all-reduce
_AS_ALL_REDUCE.reduce_scatter_tensor = False
_AS_ALL_REDUCE.avg = False

DEFAULT_PG_TIMEOUT = timedelta(minutes=int(os.environ.get("DEEPSPEED_TIMEOUT", 30)))

# Before any process group exists, so that no module import pins the default group (see lifecycle.py).
lifecycle.import_group_pinning_modules()

# ---- process groups ---------------------------------------------------------------------------------


def init_distributed(dist_backend=None,
                     auto_mpi_discovery=True,
                     distributed_port=29500,
                     verbose=True,
                     timeout=DEFAULT_PG_TIMEOUT,
                     init_method=None,
                     dist_init_required=None,
                     config=None,
                     rank=-1,
                     world_size=-1):
    """Initialise the default process group, unless it already is.

    Postconditions: torch.distributed is initialised (unless ``dist_init_required``
    is False, which leaves it as it is); ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``
    are in ``os.environ``; on CUDA the current device is ``LOCAL_RANK``; a group
    created here is destroyed at interpreter exit unless the script destroyed it. The
    backend defaults to the accelerator's (``nccl`` on CUDA, ``gloo`` on CPU).
    ``config`` (a DeepSpeed config dict or ``DeepSpeedConfig``) configures the comms logger.
    """
    peer_failure.check_usable()  # after an aborted group: the reason now, not a rendezvous that nobody joins
    peer_failure.record_uncaught_exceptions()  # under torchrun: the node agent learns which rank failed on its own
    if config is not None:
        configure(deepspeed_config=config)
    if dist_init_required is False or is_initialized():
        return

    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    launch = discover(rank=rank,
                      world_size=world_size,
                      auto_mpi_discovery=auto_mpi_discovery,
                      distributed_port=distributed_port)
    launch.export(with_rendezvous=init_method is None)

    backend = dist_backend or accelerator.communication_backend_name()
    kwargs = {}
    if accelerator.device_name() == "cuda":
        accelerator.set_device(launch.local_rank)
        if backend == "nccl":
            # Binding the group to the device lets barrier() and NCCL set-up know it up front.
            kwargs["device_id"] = torch.device("cuda", launch.local_rank)

    if verbose and launch.rank == 0:
        from deepspeed.utils.logging import logger
        logger.info(f"Initializing torch.distributed: backend={backend}, world_size={launch.world_size}, "
                    f"init_method={init_method or 'env://'}")
    fallbacks.reset_capabilities()
    dist.init_process_group(backend=backend,
                            init_method=init_method,
                            timeout=timeout,
                            world_size=launch.world_size,
                            rank=launch.rank,
                            **kwargs)
    peer_failure.record_group_timeout(timeout)
    # A group we created is destroyed before interpreter shutdown if the script does not (see lifecycle.py).
    lifecycle.destroy_at_exit()


def is_initialized():
    return dist.is_available() and dist.is_initialized()


def is_available():
    return dist.is_available()


def destroy_process_group(group=None):
    fallbacks.reset_capabilities()
    if group is None:  # a checkpoint still committed behind training needs the groups: it finishes first
        from deepspeed.runtime.checkpoint_engine.decoupled_checkpoint_engine import wait_for_pending_saves
        wait_for_pending_saves()
    if group is None:  # the mesh's groups go too: a reference kept to one keeps its threads alive
        lifecycle.run_world_teardown_hooks()
    dist.destroy_process_group(group)


def new_group(ranks=None, timeout=None, backend=None, pg_options=None):
    """A process group over ``ranks`` (global ranks); must be called by every rank, with the same ranks."""
    return dist.new_group(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options)


def get_rank(group=None):
    return dist.get_rank(group)


def get_world_size(group=None):
    return dist.get_world_size(group)


def get_local_rank():
    """This process's rank on its node (``LOCAL_RANK``, 0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group=None, group_rank=0):
    """The global rank of ``group_rank`` in ``group`` (the default group maps ranks to themselves)."""
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group=None):
    return [get_global_rank(group, r) for r in range(get_world_size(group))]


def get_world_group():
    return dist.group.WORLD


def get_backend(group=None):
    return dist.get_backend(group)


def has_all_gather_into_tensor():
    """True: ``all_gather_into_tensor`` works on every backend (natively or through its fallback)."""
    return True


def has_reduce_scatter_tensor():
    """True: ``reduce_scatter_tensor`` works on every backend (natively or through its fallback)."""
    return True


def configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None, debug=None):
    """Set up the comms logger from a config (a dict or ``DeepSpeedConfig``), then apply any explicit argument.

    The engine calls it with its config at construction. Keys: ``comms_logger.{enabled, verbose, prof_all,
    prof_ops, debug}`` (see ``deepspeed/utils/comms_logging.py``).
    """
    if deepspeed_config is not None:
        comms_config = getattr(deepspeed_config, "comms_config", None)
        if comms_config is None:
            from .config import DeepSpeedCommsConfig
            comms_config = DeepSpeedCommsConfig(deepspeed_config)
        comms_logger.configure(comms_config)
    if enabled is not None:
        comms_logger.enabled = bool(enabled)
    if prof_all is not None:
        comms_logger.prof_all = bool(prof_all)
    if prof_ops is not None:
        comms_logger.prof_ops = list(prof_ops)
    if verbose is not None:
        comms_logger.verbose = bool(verbose)
    if debug is not None:
        comms_logger.debug = bool(debug)


def log_summary(show_straggler=False, return_dict=False):
    """Print the comms logger's summary on rank 0 (every rank must call it: it synchronises the ranks).

    With ``return_dict`` returns the summary (``{"summary": {name: {msg_size: {...}}}, "straggler_analysis",
    "metadata"}``) on every rank; see ``CommsLogger.log_all``.
    """
    if is_initialized():
        dist.barrier()
    result = comms_logger.log_all(print_log=(not is_initialized() or get_rank() == 0),
                                  show_straggler=show_straggler,
                                  return_dict=return_dict)
    if is_initialized():
        dist.barrier()
    return result


# ---- collectives ------------------------------------------------------------------------------------


@timed_op
def barrier(group=None, async_op=False, device_ids=None):
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


@timed_op
def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    """torch's ``monitored_barrier`` where the backend has one (gloo), a plain barrier elsewhere."""
    if get_backend(group) == "gloo":
        return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)
    return dist.barrier(group=group)


@timed_op
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    caps = _CAPS.get(group) or _capabilities(group)
    if caps.avg or op != _AVG:
        try:
            return dist.all_reduce(tensor, op, group, async_op)
        except COLLECTIVE_ERRORS as err:
            if not caps.learn(err, "all_reduce"):
                raise
    return fallbacks.all_reduce(caps, tensor, op, group, async_op)


inference_all_reduce = all_reduce


@timed_op
def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group=None, async_op=False):
    """All-reduce a list of tensors in place with one collective per (device, dtype)."""
    caps = _capabilities(group)
    try:
        return fallbacks.all_reduce_coalesced(caps, tensors, op, group, async_op)
    except COLLECTIVE_ERRORS as err:
        if not caps.learn(err, "all_reduce"):
            raise
    return fallbacks.all_reduce_coalesced(caps, tensors, op, group, async_op)


@timed_op
def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    caps = _CAPS.get(group) or _capabilities(group)
    if caps.avg or op != _AVG:
        try:
            return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)
        except COLLECTIVE_ERRORS as err:
            if not caps.learn(err, "reduce"):
                raise
    return fallbacks.reduce(caps, tensor, dst, op, group, async_op)


@timed_op
def reduce_scatter_tensor(output_tensor, input_tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``input_tensor`` (world_size x output's size) over the group; rank r keeps chunk r."""
    caps = _CAPS.get(group) or _capabilities(group)
    if peer_failure.watching():  # a watched wait needs a handle that honours a timeout: gloo's native
        return fallbacks.reduce_scatter_tensor(_AS_ALL_REDUCE, output_tensor, input_tensor, op, group, async_op)
    if caps.reduce_scatter_tensor and (caps.avg or op != _AVG):
        try:
            return reduce_scatter_single(output_tensor, input_tensor, op, group, async_op)
        except COLLECTIVE_ERRORS as err:
            if not caps.learn(err, "reduce_scatter_tensor"):
                raise
    return fallbacks.reduce_scatter_tensor(caps, output_tensor, input_tensor, op, group, async_op)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False):
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


@timed_op
def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``input_list`` elementwise over the group; rank r receives the reduced ``input_list[r]``."""
    caps = _CAPS.get(group) or _capabilities(group)
    if caps.reduce_scatter and (caps.avg or op != _AVG):
        try:
            return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
        except COLLECTIVE_ERRORS as err:
            if not caps.learn(err, "reduce_scatter"):
                raise
    return fallbacks.reduce_scatter(caps, output, input_list, op, group, async_op)


@timed_op
def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """Concatenate every rank's ``input_tensor`` into ``output_tensor`` (rank order, along dim 0)."""
    caps = _CAPS.get(group) or _capabilities(group)
    if caps.all_gather_into_tensor:
        try:
            return all_gather_single(output_tensor, input_tensor, group, async_op)
        except COLLECTIVE_ERRORS as err:
            if not caps.learn(err, "all_gather_into_tensor"):
                raise
    return fallbacks.all_gather_into_tensor(caps, output_tensor, input_tensor, group, async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False):
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


@timed_op
def all_gather(tensor_list, tensor, group=None, async_op=False):
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


@timed_op
def broadcast(tensor, src, group=None, async_op=False):
    """Broadcast from global rank ``src``."""
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


@timed_op
def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    return dist.all_to_all_single(output,
                                  tensor,
                                  output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes,
                                  group=group,
                                  async_op=async_op)


@timed_op
def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


@timed_op
def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    return dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


@timed_op
def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    return dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


@timed_op
def send(tensor, dst, group=None, tag=0):
    return dist.send(tensor, dst, group=group, tag=tag)


@timed_op
def recv(tensor, src=None, group=None, tag=0):
    return dist.recv(tensor, src=src, group=group, tag=tag)


@timed_op
def isend(tensor, dst, group=None, tag=0):
    return dist.isend(tensor, dst, group=group, tag=tag)


@timed_op
def irecv(tensor, src=None, group=None, tag=0):
    return dist.irecv(tensor, src=src, group=group, tag=tag)


def batch_isend_irecv(ops, group=None):
    """Post point-to-point sends and receives together; returns their work handles (wait on each).

    ``ops``: ``[(kind, tensor, peer)]`` with ``kind`` ``"send"`` or ``"recv"`` and ``peer`` a global rank. On
    NCCL they form one group, so two ranks may send to each other in one batch without deadlock; with gloo
    the waits are watched like every collective's (a peer that failed makes them raise, docs/faults.md).
    """
    p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, group) for kind, tensor, peer in ops]
    works = dist.batch_isend_irecv(p2p) if p2p else []
    if peer_failure.watching():
        works = [peer_failure.WatchedWork(work, group) for work in works]
    return works


def broadcast_object_list(object_list, src, group=None, device=None):
    return dist.broadcast_object_list(object_list, src, group=group, device=device)


def all_gather_object(object_list, obj, group=None):
    return dist.all_gather_object(object_list, obj, group=group)
