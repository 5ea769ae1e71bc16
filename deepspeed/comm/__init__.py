# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.comm``: torch.distributed with environment discovery and backend fallbacks."""

from .comm import (DEFAULT_PG_TIMEOUT, all_gather, all_gather_into_tensor, all_gather_object, all_reduce,
                   all_reduce_coalesced, all_to_all, all_to_all_single, allgather_fn, barrier, broadcast,
                   broadcast_object_list, comms_logger, configure, destroy_process_group, gather,
                   get_all_ranks_from_group, get_backend, get_global_rank, get_local_rank, get_rank, get_world_group,
                   get_world_size, has_all_gather_into_tensor, has_reduce_scatter_tensor, inference_all_reduce,
                   init_distributed, irecv, is_available, is_initialized, isend, log_summary, monitored_barrier,
                   new_group, recv, reduce, reduce_scatter, reduce_scatter_fn, reduce_scatter_tensor, scatter, send)
from .comm import batch_isend_irecv  # noqa: F401  (point-to-point batches: pipeline transfers)
from .peer_failure import PeerFailureError, failure_guard, set_failure_timeout
from .reduce_op import ReduceOp

__all__ = [
    'ReduceOp', 'DEFAULT_PG_TIMEOUT', 'all_gather', 'all_gather_into_tensor', 'all_gather_object', 'all_reduce',
    'all_reduce_coalesced', 'all_to_all', 'all_to_all_single', 'allgather_fn', 'barrier', 'broadcast',
    'broadcast_object_list', 'comms_logger', 'configure', 'destroy_process_group', 'gather',
    'get_all_ranks_from_group', 'get_backend', 'get_global_rank', 'get_local_rank', 'get_rank', 'get_world_group',
    'get_world_size', 'has_all_gather_into_tensor', 'has_reduce_scatter_tensor', 'inference_all_reduce',
    'init_distributed', 'irecv', 'is_available', 'is_initialized', 'isend', 'log_summary', 'monitored_barrier',
    'new_group', 'recv', 'reduce', 'reduce_scatter', 'reduce_scatter_fn', 'reduce_scatter_tensor', 'scatter', 'send'
]
__all__ += ['batch_isend_irecv']
__all__ += ['PeerFailureError', 'failure_guard', 'set_failure_timeout']  # docs/faults.md
