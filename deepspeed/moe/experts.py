# SPDX-License-Identifier: Apache-2.0
"""The local experts of a MoE layer: ``num_local_experts`` copies of one expert module, marked as experts.

Every parameter of the copies is marked ``allreduce = False`` and ``group_name`` (see
:mod:`deepspeed.moe.utils`), so the engine reduces its gradient over its expert-data-parallel
group only.
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
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
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
