# SPDX-License-Identifier: Apache-2.0
"""``DeepSpeedCPULion``: Lion for host parameters (``optimizer.type: "Lion"`` with optimizer offload).

Upstream's constructor and state layout (``step`` and ``exp_avg``). ``fp32_optimizer_states=True`` (default)
keeps a float16/bfloat16 parameter's momentum in float32 and steps it through float32
(:mod:`deepspeed.ops.elementwise`). Stepping a parameter that is not on the host fails an assertion, as upstream's.
"""

from deepspeed.ops.elementwise import ElementwiseOptimizer
from deepspeed.ops.lion.fused_lion import LionUpdate, check_lion_args


class DeepSpeedCPULion(LionUpdate, ElementwiseOptimizer):
    """Lion on host parameters (see the module docstring)."""

    HOST_ONLY = True

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True):
        check_lion_args(lr, betas, weight_decay)
        super().__init__(model_params,
                         dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay),
                         fp32_optimizer_states=fp32_optimizer_states)
