# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.moe.layer.MoE``: a mixture-of-experts layer with its experts spread over ``ep_size`` ranks.

``MoE(hidden_size, expert, num_experts, ep_size, k, ...)`` holds a router (:class:`TopKGate`) and
``num_experts / ep_size`` local copies of ``expert``; ``forward(hidden_states)`` returns
``(output, l_aux, exp_counts)``. Expert ``e`` lives on expert-parallel rank
``e // num_local_experts`` of the layer's expert-parallel group (``ep_size_<ep>``, see
:mod:`deepspeed.utils.groups`); ``deepspeed.initialize`` builds that group and hands it to the
layer (``set_deepspeed_parallelism``). Routing, capacity and the aux loss are described in
:mod:`deepspeed.moe.sharded_moe`. ``num_experts % ep_size != 0`` is an error at construction,
on every rank.
"""

from typing import Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from deepspeed.moe.experts import Experts
from deepspeed.moe.sharded_moe import MOELayer, TopKGate
from deepspeed.utils import groups
from deepspeed.utils.logging import log_dist


class MoE(nn.Module):
    """A mixture-of-experts layer (see the module docstring)."""

    def __init__(self,
                 hidden_size: int,
                 expert: nn.Module,
                 num_experts: int = 1,
                 ep_size: int = 1,
                 k: int = 1,
                 capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0,
                 min_capacity: int = 4,
                 use_residual: bool = False,
                 noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True,
                 use_rts: bool = True,
                 use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if int(ep_size) < 1 or int(num_experts) < 1:
            raise ValueError(f"MoE: num_experts ({num_experts}) and ep_size ({ep_size}) must be positive")
        if num_experts % ep_size != 0:
            raise ValueError(f"MoE: num_experts ({num_experts}) must be divisible by ep_size ({ep_size}): every "
                             f"expert-parallel rank holds num_experts / ep_size experts")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = groups.expert_group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        log_dist(
            f"Creating MoE layer with num_experts: {num_experts} | num_local_experts: {self.num_local_experts} "
            f"| expert_parallel_size: {ep_size}", [0])
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor,
                                               min_capacity, noisy_gate_policy, drop_tokens, use_rts, None,
                                               top2_2nd_expert_sampling),
                                      experts,
                                      self.expert_group_name,
                                      self.ep_size,
                                      self.num_local_experts,
                                      use_tutel=use_tutel)
        if self.use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)  # mixes the experts' and the dense MLP's outputs

    def check_expert_layout(self):
        """Raise unless this layer can be laid out on the current world (called by the engine, every rank)."""
        if self.enable_expert_tensor_parallelism and groups.mpu is not None:
            raise NotImplementedError("MoE enable_expert_tensor_parallelism with an mpu is not supported; see "
                                      "docs/compatibility.md")

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Take this layer's expert-parallel group from the mesh (creating it there if the mesh lacks it)."""
        self._create_process_groups(use_data_before_expert_parallel_=use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(self.ep_size,
                                                    use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self.deepspeed_moe._set_ep_group(groups._get_expert_parallel_group(self.expert_group_name))

    @property
    def global_expert_indices(self):
        """The global indices of this rank's local experts (after the groups exist; ``range(num_experts)`` at ep 1)."""
        if self.ep_size == 1:
            return list(range(self.num_experts))
        first = groups._get_expert_parallel_rank(self.expert_group_name) * self.num_local_experts
        return list(range(first, first + self.num_local_experts))

    def forward(self,
                hidden_states: torch.Tensor,
                used_token: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(output, l_aux, exp_counts)`` for ``hidden_states`` ``[..., hidden_size]`` (``used_token``: a 0/1 mask
        of the tokens that route, top-1 only)."""
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
