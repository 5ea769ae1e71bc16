# SPDX-License-Identifier: Apache-2.0
"""Which way round a model's fused expert weights are stored (upstream's ``deepspeed.moe.fused_expert_layout``).

Transformers' fused MoE experts keep two 3-D parameters per block, ``gate_up_proj`` (gate and up projections of
every expert, concatenated) and ``down_proj``. Two layouts occur, for ``E`` experts, hidden size ``H`` and
expert FFN size ``F``:

=================  ==========================  ======================  ===================================
layout             ``gate_up_proj``            ``down_proj``           applied as
=================  ==========================  ======================  ===================================
``gate_up_first``  ``[E, 2F, H]``              ``[E, H, F]``           ``F.linear(x, w)`` (torch's layout)
``hidden_first``   ``[E, H, 2F]``              ``[E, F, H]``           ``x @ w`` (needs a transpose)
=================  ==========================  ======================  ===================================

:func:`classify_fused_gate_up_layout` tells them apart from the two shapes alone (they can never both fit), or
returns None when neither fits. AutoEP (``deepspeed.moe.autoep``) checks each block's experts with it.
"""

from typing import NamedTuple, Optional, Sequence


class FusedGateUpLayout(NamedTuple):
    layout: str  # "gate_up_first" or "hidden_first"
    hidden_size: int
    ffn_hidden_size: int
    needs_transpose: bool  # hidden_first: the weights are applied as x @ w, not F.linear(x, w)


def classify_fused_gate_up_layout(gate_up_shape: Sequence[int],
                                  down_shape: Sequence[int]) -> Optional[FusedGateUpLayout]:
    """The layout of fused expert weights of these shapes (see the module docstring), or None."""
    gate_up, down = tuple(gate_up_shape), tuple(down_shape)
    if len(gate_up) != 3 or len(down) != 3 or gate_up[0] != down[0]:
        return None
    _, a, b = gate_up
    if a % 2 == 0 and down[1:] == (b, a // 2):
        return FusedGateUpLayout("gate_up_first", hidden_size=b, ffn_hidden_size=a // 2, needs_transpose=False)
    if b % 2 == 0 and down[1:] == (b // 2, a):
        return FusedGateUpLayout("hidden_first", hidden_size=a, ffn_hidden_size=b // 2, needs_transpose=True)
    return None
