# SPDX-License-Identifier: Apache-2.0
"""Flat, contiguous gradient storage and the buckets that are views into it.

Layout is fixed at construction and identical on every rank: parameters are laid
out in *reverse* registration order (roughly the order backward produces their
gradients), and cut into buckets of about ``bucket_numel`` elements. A parameter
larger than a bucket gets a bucket of its own. Buckets are numbered in layout
order, and reductions always go in that order, so every rank issues the same
collectives in the same sequence whatever order its hooks fired in.
"""

from dataclasses import dataclass, field

import torch


@dataclass
class GradBucket:
    """A contiguous slice ``[start, end)`` of a flat buffer holding whole parameters."""
    index: int
    start: int
    end: int
    params: list = field(default_factory=list)

    @property
    def numel(self):
        return self.end - self.start


@dataclass
class ParamSlot:
    """Where one parameter's gradient lives in the flat layout."""
    index: int  # position in layout order
    offset: int
    numel: int
    shape: torch.Size
    bucket: int


class FlatLayout:
    """Offsets of parameters in one flat buffer, and its buckets."""

    def __init__(self, params, bucket_numel, key=None):
        """``key(param)``, when given, keeps parameters with different keys in different buckets."""
        self.params = list(reversed(list(params)))
        self.slots = {}
        self.buckets = []
        bucket_numel = max(int(bucket_numel), 1)
        offset = 0
        current = None
        current_key = None
        for index, param in enumerate(self.params):
            numel = param.numel()
            param_key = key(param) if key is not None else None
            if (current is None or (current.numel > 0 and current.numel + numel > bucket_numel)
                    or param_key is not current_key):
                current_key = param_key
                current = GradBucket(index=len(self.buckets), start=offset, end=offset)
                self.buckets.append(current)
            self.slots[param] = ParamSlot(index=index,
                                          offset=offset,
                                          numel=numel,
                                          shape=param.shape,
                                          bucket=current.index)
            current.params.append(param)
            offset += numel
            current.end = offset
        self.numel = offset

    def new_buffer(self, dtype, device):
        return torch.zeros(self.numel, dtype=dtype, device=device)

    def view(self, buffer, param):
        slot = self.slots[param]
        return buffer.narrow(0, slot.offset, slot.numel).view(slot.shape)

    def bucket_view(self, buffer, bucket):
        return buffer.narrow(0, bucket.start, bucket.numel)
