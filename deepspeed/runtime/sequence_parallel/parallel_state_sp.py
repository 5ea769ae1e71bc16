# SPDX-License-Identifier: Apache-2.0
"""The ``mpu`` of Ulysses sequence parallelism: the sequence-parallel and sequence-data-parallel groups.

``UlyssesSPAttentionHF.register_with_transformers`` returns this module; pass it to
``deepspeed.initialize(..., mpu=mpu)``. It creates no group itself: :func:`initialize_sequence_parallel` builds the
run's mesh (:mod:`deepspeed.utils.groups`, contiguous sequence-parallel groups: ``[0, 1], [2, 3]`` for size 2 of
world 4) and the getters read it, so the engine, the Trainer's loss (``groups._get_sequence_parallel_group()``) and
this module name the same groups.

Unlike upstream's module it has no ``get_model_parallel_*`` aliases of the sequence-parallel getters: the engine
reads an mpu's model-parallel size as tensor parallelism, which a sequence-parallel run does not have.
"""

import deepspeed.comm as dist
from deepspeed.utils import groups

__all__ = [
    "initialize_sequence_parallel", "get_sequence_parallel_group", "get_sequence_parallel_world_size",
    "get_sequence_parallel_rank", "get_sequence_data_parallel_group", "get_sequence_data_parallel_world_size",
    "get_sequence_data_parallel_rank"
]


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Build the mesh with sequence-parallel groups of ``sequence_parallel_size`` (a collective on every rank).

    Raises ``RuntimeError``/``ValueError`` on every rank, before any collective, if the size is below 2, exceeds
    or does not divide the world. Calling it again with the same size reuses the groups.
    """
    if not dist.is_initialized():
        raise RuntimeError("initialize_sequence_parallel: torch.distributed is not initialized "
                           "(call deepspeed.init_distributed() first)")
    world = dist.get_world_size()
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    if world < sequence_parallel_size or world % sequence_parallel_size != 0:
        raise RuntimeError(f"world size ({world}) must be a multiple of sequence_parallel_size "
                           f"({sequence_parallel_size})")
    mesh = groups.current_mesh() if groups._MESH is not None else None
    if mesh is not None and mesh.description.sequence_parallel_size == sequence_parallel_size:
        return
    groups.initialize_mesh(sequence_parallel_size=sequence_parallel_size)


def get_sequence_parallel_group():
    return groups._get_sequence_parallel_group()


def get_sequence_parallel_world_size():
    return groups._get_sequence_parallel_world_size()


def get_sequence_parallel_rank():
    return groups._get_sequence_parallel_rank()


def get_sequence_data_parallel_group():
    return groups._get_sequence_data_parallel_group()


def get_sequence_data_parallel_world_size():
    return groups._get_sequence_data_parallel_world_size()


def get_sequence_data_parallel_rank():
    return groups._get_sequence_data_parallel_rank()
