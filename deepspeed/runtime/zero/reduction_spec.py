# SPDX-License-Identifier: Apache-2.0
"""Which group a parameter's gradient is reduced (and partitioned) over, and what the mean divides by.

A :class:`ReductionSpec` is attached to every bucket of the gradient pipeline: the bucket is
reduced over ``group`` (``world_size`` ranks, this rank ``rank`` in it), its contributions are
scaled by ``1 / divisor`` when the reduction is a mean, and ZeRO partitions it over the same
group. A :class:`ReductionPlan` gives each parameter its spec: the dense spec, or the spec of
its expert group (``param.group_name``, for parameters marked ``allreduce=False``).

The default plan has one spec, the data-parallel group with divisor its size: the reduction
every stage did before expert and sequence parallelism existed, bit for bit.
"""

from dataclasses import dataclass, field
from typing import Any, Dict

import deepspeed.comm as dist


@dataclass(frozen=True)
class ReductionSpec:
    """How one bucket is reduced (module docstring). ``group`` None is the default group."""
    group: Any
    world_size: int
    rank: int
    divisor: int
    name: str = "dense"

    def scale(self, average):
        """The factor a contribution takes so that the sum over ``group`` is the mean (or the sum)."""
        return 1.0 / self.divisor if average else 1.0


def default_spec(group=None):
    """The spec of a plain data-parallel reduction over ``group``: its size is the divisor."""
    if dist.is_initialized():
        world, rank = dist.get_world_size(group), dist.get_rank(group)
    else:
        world, rank = 1, 0
    return ReductionSpec(group=group, world_size=world, rank=rank, divisor=world)


@dataclass
class ReductionPlan:
    """Each parameter's :class:`ReductionSpec` (module docstring)."""
    dense: ReductionSpec
    experts: Dict[str, ReductionSpec] = field(default_factory=dict)

    @classmethod
    def single(cls, group=None):
        return cls(default_spec(group))

    def spec_of(self, param):
        if getattr(param, "allreduce", True):
            return self.dense
        name = getattr(param, "group_name", None)
        spec = self.experts.get(name)
        if spec is None:
            raise ValueError(f"an expert parameter of shape {tuple(param.shape)} names expert group {name!r}, which "
                             f"the mesh does not have (groups: {sorted(self.experts)})")
        return spec

    def specs(self):
        """Every spec, dense first, then the expert groups' by name."""
        return [self.dense] + [self.experts[name] for name in sorted(self.experts)]

    def has_experts(self, params):
        return any(self.spec_of(p) is not self.dense for p in params)
