# SPDX-License-Identifier: Apache-2.0
"""The typed settings of one disk tier (what a ZeRO stage takes from ``offload_*`` with ``device: nvme`` and ``aio``).

:func:`optimizer_swap_config` and :func:`param_swap_config` build them from the parsed config sections; the stage
config (``zero/stages.py``) carries them, so nothing below reads the DeepSpeed config itself.
"""

from dataclasses import dataclass

from deepspeed.runtime.swap_tensor.constants import (AIO_BLOCK_SIZE_DEFAULT, AIO_INTRA_OP_PARALLELISM_DEFAULT,
                                                     AIO_OVERLAP_EVENTS_DEFAULT, AIO_QUEUE_DEPTH_DEFAULT,
                                                     AIO_SINGLE_SUBMIT_DEFAULT)

# Elements of one optimizer page at most (each page holds the master and both moments: 12 bytes an element, so
# 192 MiB a page): larger pages read no faster, and ``sub_group_size``'s default (1e9) would pin 12 GB a buffer.
OPTIMIZER_PAGE_CAP = 1 << 24
OPTIMIZER_KEY = "zero_optimization.offload_optimizer"
PARAM_KEY = "zero_optimization.offload_param"


@dataclass(frozen=True)
class AioSettings:
    """The ``aio`` section: how the aio handle of a tier moves bytes."""
    block_size: int = AIO_BLOCK_SIZE_DEFAULT
    queue_depth: int = AIO_QUEUE_DEPTH_DEFAULT
    intra_op_parallelism: int = AIO_INTRA_OP_PARALLELISM_DEFAULT
    single_submit: bool = AIO_SINGLE_SUBMIT_DEFAULT
    overlap_events: bool = AIO_OVERLAP_EVENTS_DEFAULT

    def open(self):
        """A new aio engine with these settings (the compiled op where it loads)."""
        from deepspeed.ops.aio.backends import open_io
        return open_io(self.block_size, self.queue_depth, self.single_submit, self.overlap_events,
                       self.intra_op_parallelism)


@dataclass(frozen=True)
class SwapConfig:
    """One disk tier: where its files go (``nvme_path``, ``key`` naming the config section for messages), pages of at
    most ``page_numel`` elements, a cache of at least ``buffer_count`` pages and ``cache_numel`` elements."""
    nvme_path: str
    key: str
    page_numel: int
    buffer_count: int
    cache_numel: int = 0
    pin_memory: bool = True
    aio: AioSettings = AioSettings()

    def slots(self, page_numel):
        """Cache slots for pages of ``page_numel`` elements."""
        by_elements = self.cache_numel // max(1, page_numel) if self.cache_numel else 0
        return max(int(self.buffer_count), int(by_elements), 1)


def aio_settings(aio_config):
    """:class:`AioSettings` from the parsed ``aio`` section (a mapping; ``thread_count`` is the old name of
    ``intra_op_parallelism``)."""
    get = aio_config.get if hasattr(aio_config, "get") else lambda k, d=None: getattr(aio_config, k, d)
    intra = get("intra_op_parallelism", None)
    if intra is None:
        intra = get("thread_count", AIO_INTRA_OP_PARALLELISM_DEFAULT)
    return AioSettings(block_size=int(get("block_size", AIO_BLOCK_SIZE_DEFAULT)),
                       queue_depth=int(get("queue_depth", AIO_QUEUE_DEPTH_DEFAULT)),
                       intra_op_parallelism=int(intra),
                       single_submit=bool(get("single_submit", AIO_SINGLE_SUBMIT_DEFAULT)),
                       overlap_events=bool(get("overlap_events", AIO_OVERLAP_EVENTS_DEFAULT)))


def optimizer_swap_config(section, aio, sub_group_size):
    """The optimizer tier of ``offload_optimizer`` (``device: nvme``): pages of ``min(sub_group_size, 2**24)``
    elements, ``buffer_count`` of them cached (at least 3: one read ahead, one stepped, one written behind)."""
    return SwapConfig(nvme_path=section.nvme_path,
                      key=f"{OPTIMIZER_KEY}.nvme_path",
                      page_numel=max(1, min(int(sub_group_size), OPTIMIZER_PAGE_CAP)),
                      buffer_count=max(3, int(section.buffer_count)),
                      pin_memory=bool(section.pin_memory),
                      aio=aio)


def param_swap_config(section, aio):
    """The parameter tier of ``offload_param`` (``device: nvme``): pages of ``buffer_size`` elements at most, a cache
    of ``max(buffer_count pages, max_in_cpu elements)``."""
    return SwapConfig(nvme_path=section.nvme_path,
                      key=f"{PARAM_KEY}.nvme_path",
                      page_numel=max(1, int(section.buffer_size)),
                      buffer_count=max(2, int(section.buffer_count)),
                      cache_numel=int(section.max_in_cpu),
                      pin_memory=bool(section.pin_memory),
                      aio=aio)
