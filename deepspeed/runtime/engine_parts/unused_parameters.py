# SPDX-License-Identifier: Apache-2.0
"""``zero_optimization.ignore_unused_parameters: false``: a parameter that got no gradient is an error.

By default (``true``) a trainable parameter that no backward of the window reached is handled like any other
(its gradient is zero, every rank issues the same collectives). With ``false``, as upstream, it is an error: at
each accumulation boundary the ranks compare which trainable parameters received a gradient in the window (one
all-reduce of one flag per parameter), and if any parameter received none on some rank, ``step()`` raises
:class:`UnusedParametersError` on every rank, naming the parameters and the ranks, before the optimizer step
(and before any other collective of the step). Applies to ZeRO stages 1-3 (the key belongs to the ZeRO section).
"""

import torch

import deepspeed.comm as dist


class UnusedParametersError(RuntimeError, AssertionError):
    """Trainable parameters that were not used in producing the loss, with ``ignore_unused_parameters: false``."""


class UnusedParameterCheck:
    """Records which trainable parameters of ``module`` received a gradient since the last :meth:`reset`."""

    def __init__(self, module, group=None, device=None):
        self.names = [name for name, p in module.named_parameters() if p.requires_grad]
        params = dict(module.named_parameters())
        self._params = [params[name] for name in self.names]
        self.group = group
        self.device = device
        self.used = [False] * len(self.names)
        self.handles = [
            params[name].register_post_accumulate_grad_hook(self._marker(i)) for i, name in enumerate(self.names)
        ]

    def _marker(self, index):

        def mark(_param):
            self.used[index] = True

        return mark

    def mark(self, params):
        """Record gradients that reached ``params`` without autograd accumulating them (a weight-gradient pass)."""
        index = {id(p): i for i, p in enumerate(self._params)}
        for p in params:
            if id(p) in index:
                self.used[index[id(p)]] = True

    def reset(self):
        self.used = [False] * len(self.names)

    def check(self):
        """Raise :class:`UnusedParametersError` on every rank if a parameter went unused on some rank; reset."""
        unused = torch.tensor([0 if u else 1 for u in self.used], dtype=torch.int32, device=self.device)
        self.reset()
        world = dist.get_world_size(group=self.group) if dist.is_initialized() else 1
        if world > 1:
            per_rank = [torch.zeros_like(unused) for _ in range(world)]
            dist.all_gather(per_rank, unused, group=self.group)
        else:
            per_rank = [unused]
        found = {}
        for rank, flags in enumerate(per_rank):
            for index in flags.nonzero().flatten().tolist():
                found.setdefault(self.names[index], []).append(rank)
        if not found:
            return
        listing = "; ".join(f"{name} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})"
                            for name, r in found.items())
        raise UnusedParametersError(
            f"The module has parameters that were not used in producing the loss: {listing}. Enable "
            f"ignore_unused_parameters in the zero_optimization config, or make sure all trainable parameters and "
            f"forward outputs take part in the loss.")

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []
