# SPDX-License-Identifier: Apache-2.0
"""Swapping training state to NVMe (ZeRO-Infinity), under upstream's module paths.

This package's disk tiers, built by the ZeRO stages from ``offload_optimizer`` / ``offload_param`` with
``device: nvme`` (docs/offload.md):

* ``optimizer_swap.OptimizerStateSwap``: fp32 masters and Adam moments (ZeRO 1, 2 and 3), read ahead of the offloaded
  step's pieces and written behind them (upstream's ``PartitionedOptimizerSwapper``, ``PipelinedOptimizerSwapper``
  and ``OptimizerSwapper`` are this class);
* ``param_swap.ParamShardSwap``: ZeRO-3's 16-bit parameter shards, read page by page for gathers (upstream's
  ``AsyncPartitionedParameterSwapper``);
* on ``paged_store`` (pages and a cache of aligned host buffers), ``swap_folder`` (the rank's folder, its lock and
  checks), ``swap_config`` (the typed settings) and the aio handle of ``deepspeed.ops.aio``.

``utils`` (``SwapBuffer``, ``SwapBufferPool``, ``SwapBufferManager``, ``swap_in_tensors``, ``swap_out_tensors``,
``get_sized_buffer(s)``, ``MIN_AIO_BYTES``, ``AIO_ALIGNED_BYTES``), ``async_swapper.AsyncTensorSwapper``,
``aio_config.get_aio_config`` and ``constants`` are upstream's helpers, implemented on the same aio handle.
"""

from .utils import MIN_SWAPPABLE_BYTES  # noqa: F401
