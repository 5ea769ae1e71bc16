# SPDX-License-Identifier: Apache-2.0
"""``get_aio_config(param_dict)``: the ``aio`` section with upstream's defaults filled in (a plain dict).

The values configure the aio handles of NVMe offload (``swap_config.aio_settings`` reads the engine's parsed copy).
``thread_count``, the old name of ``intra_op_parallelism``, is taken when the new one is absent. ``use_gds`` needs a
CUDA accelerator (and is not supported by NVMe offload here)."""

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.swap_tensor.constants import (AIO, AIO_BLOCK_SIZE, AIO_BLOCK_SIZE_DEFAULT,
                                                     AIO_INTRA_OP_PARALLELISM, AIO_INTRA_OP_PARALLELISM_DEFAULT,
                                                     AIO_OVERLAP_EVENTS, AIO_OVERLAP_EVENTS_DEFAULT, AIO_QUEUE_DEPTH,
                                                     AIO_QUEUE_DEPTH_DEFAULT, AIO_SINGLE_SUBMIT,
                                                     AIO_SINGLE_SUBMIT_DEFAULT, AIO_USE_GDS, AIO_USE_GDS_DEFAULT)

AIO_DEFAULT_DICT = {
    AIO_BLOCK_SIZE: AIO_BLOCK_SIZE_DEFAULT,
    AIO_QUEUE_DEPTH: AIO_QUEUE_DEPTH_DEFAULT,
    AIO_INTRA_OP_PARALLELISM: AIO_INTRA_OP_PARALLELISM_DEFAULT,
    AIO_SINGLE_SUBMIT: AIO_SINGLE_SUBMIT_DEFAULT,
    AIO_OVERLAP_EVENTS: AIO_OVERLAP_EVENTS_DEFAULT,
    AIO_USE_GDS: AIO_USE_GDS_DEFAULT,
}


def get_aio_config(param_dict):
    """The ``aio`` section of ``param_dict`` over :data:`AIO_DEFAULT_DICT` (the defaults when absent)."""
    section = param_dict.get(AIO)
    if section is None:
        return dict(AIO_DEFAULT_DICT)
    config = {key: section.get(key, default) for key, default in AIO_DEFAULT_DICT.items()}
    if AIO_INTRA_OP_PARALLELISM not in section and "thread_count" in section:
        config[AIO_INTRA_OP_PARALLELISM] = section["thread_count"]
    if config[AIO_USE_GDS] and get_accelerator().device_name().split(":")[0] != "cuda":
        raise ValueError("aio.use_gds needs a CUDA accelerator")
    return config
