# SPDX-License-Identifier: Apache-2.0
"""How upstream's ZeRO-3 files cut a parameter: into equal shards over the ranks of its partition group, the last
padded, each rank's flat group the concatenation of its shards in ``param_shapes`` order. Read by the upstream
reader (``upstream_format``, ``upstream_autoep``) and written by ``upstream_writer``."""

import math

import torch


def zero3_shard_numel(numel, world):
    """Elements of each rank's shard of a parameter of ``numel`` elements on stage 3 (the last ones padded)."""
    return int(math.ceil(numel / world)) if numel else 0


def join_zero3_shards(parts, numel, offset, too_short):
    """``(flat value, shard)``: a parameter of ``numel`` elements whose shards start at ``offset`` of each of
    ``parts`` (the flat groups of its partition group's ranks, in partition order); ``too_short(k)`` raises for part
    ``k`` ending before its shard does."""
    shard = zero3_shard_numel(numel, len(parts))
    chunks = []
    for k, part in enumerate(parts):
        take = max(0, min(shard, numel - k * shard))
        if offset + take > part.numel():
            too_short(k)
        chunks.append(part.narrow(0, offset, take))
    return torch.cat(chunks), shard
