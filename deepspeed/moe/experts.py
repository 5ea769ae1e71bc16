# SPDX-License-Identifier: Apache-2.0
"""The local experts of a MoE layer: ``num_local_experts`` copies of one expert module, marked as experts.

Every parameter of the copies is marked ``allreduce = False`` and ``group_name`` (see
:mod:`deepspeed.moe.utils`), so the engine reduces its gradient over its expert-data-parallel
group only.

Under ``deepspeed.zero.Init`` the expert given is partitioned when built (its ``__init__`` returned inside the
context), and a copy of a partitioned parameter would be empty: the copies are taken from its whole value
(gathered, rank 0's as ``zero.Init`` made it) and stay whole, plain parameters (a copy's ``__init__`` does not
run, so ``zero.Init`` does not partition it), which each rank may then set to its own experts' values. The ZeRO-3
engine shards them over their expert-data-parallel group at ``initialize``.
"""

import copy
from typing import Optional

import torch
from torch import nn

from deepspeed.moe.utils import mark_expert_param


class Experts(nn.Module):
    """``num_local_experts`` copies of ``expert``; ``forward`` runs copy ``l`` on slice ``[:, l]`` of its input."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: Optional[str] = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(_copies(expert, num_local_experts))
        self.num_local_experts = num_local_experts
        for param in self.deepspeed_experts.parameters():
            mark_expert_param(param, expert_group_name)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs`` ``[G, num_local_experts, C, d]`` -> ``[G, num_local_experts, C, d_out]``."""
        outputs = []
        for index, expert in enumerate(self.deepspeed_experts):
            out = expert(inputs[:, index])
            if isinstance(out, tuple):
                out = out[0]  # an expert returning (output, bias): the output
            outputs.append(out)
        return torch.stack(outputs, dim=1)


def _copies(expert, count):
    """``count`` deep copies of ``expert``, whole even where ``zero.Init`` partitioned its parameters."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, is_zero_param
    partitioned = [p for p in expert.parameters() if is_zero_param(p)]
    if not partitioned:
        return [copy.deepcopy(expert) for _ in range(count)]
    with GatheredParameters(partitioned):  # a collective: every rank builds the same layer
        copies = [copy.deepcopy(expert) for _ in range(count)]
    for module in copies:
        for p in module.parameters():
            for name in [a for a in vars(p) if a.startswith("ds_")] + ["all_gather_coalesced"]:
                if name in vars(p):
                    delattr(p, name)
    return copies
