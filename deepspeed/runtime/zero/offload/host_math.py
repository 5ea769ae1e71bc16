# SPDX-License-Identifier: Apache-2.0
"""Reductions over large host tensors, on every core.

Torch reduces one huge CPU tensor to a scalar far under the memory bandwidth (measured on the
reference offload run: the squared norm of a 1.3e9-element fp32 gradient partition took 0.56 s,
about 9 GB/s, while the fused CPU Adam step over the same partition moved 137 GB/s). The
functions here cut the tensors into chunks of :data:`CHUNK` elements and reduce the chunks on
a pool of threads with one intra-op thread each (torch releases the GIL inside its kernels),
then add the partial results in float64. A non-finite element makes the result non-finite
(the overflow check reads it). Results differ from a single torch reduction only by the
order of the additions.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from deepspeed.runtime.zero.offload.host_worker import host_cores

CHUNK = 1 << 22  # elements per task
PARALLEL_MIN = 1 << 24  # below this many elements, one torch call is as fast

_executor = None
_lock = threading.Lock()


def _pool():
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=host_cores(),
                                           thread_name_prefix="ds-host-math",
                                           initializer=torch.set_num_threads,
                                           initargs=(1, ))
        return _executor


def _chunk_sq(chunk):
    if chunk.dtype == torch.float32 and chunk.dim() == 1 and chunk.is_contiguous():
        return float(torch.dot(chunk, chunk))
    return float(torch.linalg.vector_norm(chunk, dtype=torch.float32))**2


def sum_of_squares(tensors):
    """The sum of the squares of every element of ``tensors`` (host tensors), as a Python float."""
    tensors = [t.reshape(-1) for t in tensors if t.numel()]
    total = sum(t.numel() for t in tensors)
    if total < PARALLEL_MIN:
        return sum(_chunk_sq(t) for t in tensors)
    chunks = [t.narrow(0, s, min(CHUNK, t.numel() - s)) for t in tensors for s in range(0, t.numel(), CHUNK)]
    return float(sum(_pool().map(_chunk_sq, chunks)))


def row_sq_norms(block, out):
    """``out[i] = sum(block[i] ** 2)`` (float32) for a 2-D host ``block``, rows reduced on several threads."""
    rows, row_len = block.shape
    if rows * row_len < PARALLEL_MIN:
        out.copy_(torch.linalg.vector_norm(block, dim=1, dtype=torch.float32)**2)
        return out
    step = max(1, CHUNK // max(1, row_len))

    def run(start):
        n = min(step, rows - start)
        out.narrow(0, start,
                   n).copy_(torch.linalg.vector_norm(block.narrow(0, start, n), dim=1, dtype=torch.float32)**2)

    list(_pool().map(run, range(0, rows, step)))
    return out
