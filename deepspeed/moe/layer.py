# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.moe.layer.MoE``: importable with upstream's constructor signature, not built yet.

Model code and upstream's test helpers import ``MoE`` at module level, so the name must exist even where
no MoE layer is built. Expert parallelism is not part of this release: constructing ``MoE`` raises
``NotImplementedError`` (see docs/compatibility.md).
"""

from typing import Optional

from torch import nn


class MoE(nn.Module):
    """A mixture-of-experts layer: ``num_experts`` copies of ``expert``, ``k`` of them chosen per token."""

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
        raise NotImplementedError("deepspeed.moe.layer.MoE: mixture-of-experts layers (expert parallelism) are not "
                                  "supported yet in this release; see docs/compatibility.md")
