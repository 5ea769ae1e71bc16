# SPDX-License-Identifier: Apache-2.0
"""Which group a parameter's gradient is reduced (and partitioned) over, and what the mean divides by.

A :class:`ReductionSpec` is attached to every bucket of the gradient pipeline: the bucket is
reduced over ``group`` (``world_size`` ranks, this rank ``rank`` in it), its contributions are
scaled by ``1 / divisor`` when the reduction is a mean, and ZeRO partitions it over the same
group. A :class:`ReductionPlan` gives each parameter its spec: the dense spec, the spec of
its expert group (``param.group_name``, for parameters marked ``allreduce=False``), or, in a
tensor-parallel model, the spec of a parameter replicated over the tensor-parallel group
(``ds_tp_replicated``: ``"sum"`` or ``"mean"``, see ``runtime/tensor_parallel/replicated.py``).

A tensor-parallel spec is partitioned over the data-parallel ``group`` like the dense one and
summed over ``tensor_group`` (``tensor_size`` ranks) as well: in one all-reduce over
``union_group`` (both, stage 0), or in two steps (stages 1-2: the reduce-scatter's chunk over the
tensor group; stage 3: the shards, once per window).
``replicas`` is how many identical whole gradients the reduction adds up (a ``"mean"``
parameter's: one per tensor-parallel rank); contributions are divided by it too, so the sum is
the gradient once. ``norm_group`` is where a stage adds up its partitions' squared norms: every
rank whose gradient pieces differ (the stage's data x tensor-parallel ranks; None: the stage's
own group).

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
    replicas: int = 1
    tensor_group: Any = None
    tensor_size: int = 1
    union_group: Any = None  # group and tensor_group together (None: the default group)

    @property
    def copies(self):
        """On how many ranks the reduced gradient of this spec's parameters is the same (all its partitions')."""
        return self.tensor_size

    def scale(self, average):
        """The factor a contribution takes so that the sum over ``group`` is the mean (or the sum)."""
        return (1.0 / self.divisor if average else 1.0) / self.replicas


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
    tensor: Dict[str, ReductionSpec] = field(default_factory=dict)  # "sum" / "mean" -> spec (tensor parallelism)
    norm_group: Any = None
    norm_size: int = 0  # ranks in norm_group (0: the stage's own group)

    @classmethod
    def single(cls, group=None):
        return cls(default_spec(group))

    def spec_of(self, param):
        if getattr(param, "allreduce", True):
            kind = getattr(param, "ds_tp_replicated", None) if self.tensor else None
            return self.tensor[kind] if kind is not None else self.dense
        name = getattr(param, "group_name", None)
        spec = self.experts.get(name)
        if spec is None:
            raise ValueError(f"an expert parameter of shape {tuple(param.shape)} names expert group {name!r}, which "
                             f"the mesh does not have (groups: {sorted(self.experts)})")
        return spec

    def specs(self):
        """Every spec, dense first, then the expert groups' by name."""
        return ([self.dense] + [self.experts[name] for name in sorted(self.experts)] +
                [self.tensor[kind] for kind in sorted(self.tensor)])

    def has_experts(self, params):
        experts = {id(spec) for spec in self.experts.values()}
        return any(id(self.spec_of(p)) in experts for p in params)

    def is_mixed(self, params):
        """Whether some of ``params`` are reduced over another group than the dense one."""
        return any(self.spec_of(p) is not self.dense for p in params)
