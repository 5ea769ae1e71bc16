# SPDX-License-Identifier: Apache-2.0
"""Reduction operators for ``deepspeed.comm`` collectives.

``ReduceOp`` is torch.distributed's own, so values pass straight through to
the backend with no translation on the hot path.
"""

from torch.distributed import ReduceOp

__all__ = ["ReduceOp"]
