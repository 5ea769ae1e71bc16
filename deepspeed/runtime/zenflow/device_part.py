# SPDX-License-Identifier: Apache-2.0
"""ZenFlow's device part: the selected elements' fp32 values and Adam moments, stepped every optimizer step.

One flat tensor per param group (the *selected buffer* layout of
:class:`~deepspeed.runtime.zenflow.selection.RowSelection`) holds the values, and two more the
moments. At every selection the values are loaded from the fp32 masters and the moments start
at zero (a new selection starts a new Adam run: its bias correction counts the steps since
the selection). Each step is torch's Adam (``torch.optim.adam.adam``: fused on CUDA, the
single-tensor implementation on the CPU) with the inner optimizer's hyperparameters of that
group as they are at the step (LR schedules apply), on the step's clipped gradient.

With ``zenflow.offload`` the three tensors stay in pinned host memory between steps and are
copied to the device around each step, so the device part takes device memory only while it
steps (after backward, when activations are gone).
"""

import torch
from torch.optim.adam import adam as functional_adam

from deepspeed.runtime.zero.offload.transfers import DONE, HostTransfers, pinned


def adam_hyperparameters(group):
    """The Adam hyperparameters of one optimizer param group; NotImplementedError for what ZenFlow cannot do."""
    if group.get("amsgrad", False):
        raise NotImplementedError("zero_optimization.zenflow does not support amsgrad")
    if group.get("maximize", False):
        raise NotImplementedError("zero_optimization.zenflow does not support maximize")
    beta1, beta2 = group["betas"]
    return dict(lr=float(group["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                eps=float(group["eps"]),
                weight_decay=float(group.get("weight_decay", 0.0)),
                decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)))


def check_adam(optimizer):
    """ValueError unless ``optimizer`` is an Adam/AdamW (ZenFlow steps the selected part with Adam)."""
    if not isinstance(optimizer, torch.optim.Adam) and not isinstance(optimizer, torch.optim.AdamW):
        raise ValueError(f"zero_optimization.zenflow needs an Adam or AdamW optimizer (the selected rows are stepped "
                         f"with Adam on the device), got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        adam_hyperparameters(group)


class DevicePart:
    """The selected elements' values and moments (see the module docstring)."""

    def __init__(self, device, offload=False, pin_memory=True):
        self.device = torch.device(device)
        self.offload = bool(offload)
        self.pin_memory = pin_memory
        self.transfers = HostTransfers(self.device)
        self._home_copy = DONE  # the copies of the last step's results home (offload), on the side stream
        self._fetched = None  # (device tensors per group, their copy): offloaded state already on its way in
        self.values = []
        self.exp_avg = []
        self.exp_avg_sq = []
        self.steps = 0  # steps since the selection

    def _home(self, tensor):
        if self.offload:
            return pinned(tensor.to("cpu"), self.pin_memory)
        return tensor.to(self.device)

    @torch.no_grad()
    def reset(self, values):
        """A new selection: ``values[g]`` (fp32, any device) are the selected elements' values; moments start at 0."""
        self._fetched = None
        self.values = [self._home(v.float()) for v in values]
        self.exp_avg = [torch.zeros_like(v) for v in self.values]
        self.exp_avg_sq = [torch.zeros_like(v) for v in self.values]
        self.steps = 0

    def load(self, values, exp_avg, exp_avg_sq, steps):
        """Restore a saved device part (a checkpoint)."""
        self._fetched = None
        self.values = [self._home(v.float()) for v in values]
        self.exp_avg = [self._home(v.float()) for v in exp_avg]
        self.exp_avg_sq = [self._home(v.float()) for v in exp_avg_sq]
        self.steps = int(steps)

    @torch.no_grad()
    def step(self, grads, param_groups):
        """One Adam step of every group's selected values with ``grads[g]`` (device tensors); returns the device
        values (for writing into the model)."""
        self.steps += 1
        on_device = [self._on_device(g) for g in range(len(self.values))]
        fused = self.device.type == "cuda"
        for g, (values, exp_avg, exp_avg_sq) in enumerate(on_device):
            if values.numel() == 0:
                continue
            hp = adam_hyperparameters(param_groups[g])
            step = torch.tensor(float(self.steps - 1),
                                dtype=torch.float32,
                                device=self.device if fused else torch.device("cpu"))
            functional_adam([values], [grads[g]], [exp_avg], [exp_avg_sq], [], [step],
                            foreach=False,
                            fused=fused,
                            capturable=False,
                            differentiable=False,
                            has_complex=False,
                            amsgrad=False,
                            maximize=False,
                            **hp)
        if self.offload:  # home on the side stream: the next forward does not wait for these copies
            pairs = []
            for g, tensors in enumerate(on_device):
                pairs += list(zip((self.values[g], self.exp_avg[g], self.exp_avg_sq[g]), tensors))
            self._home_copy = self.transfers.copy_many(pairs)
            self._fetched = None
        return [values for values, _, _ in on_device]

    def prefetch(self):
        """Offload: start copying the values and moments to the device on the side stream (the next :meth:`step`
        uses them), so the copy overlaps the host work before the step. Idempotent; a no-op without offload."""
        if not self.offload or self._fetched is not None or not self.values:
            return
        groups, pairs = [], []
        for g in range(len(self.values)):
            homes = (self.values[g], self.exp_avg[g], self.exp_avg_sq[g])
            devs = tuple(torch.empty_like(h, device=self.device) for h in homes)
            groups.append(devs)
            pairs += list(zip(devs, homes))
        # after the previous step's copies home (same side stream), which wrote these host tensors
        self._fetched = (groups, self.transfers.copy_many(pairs))

    def _on_device(self, g):
        if not self.offload:
            return (self.values[g], self.exp_avg[g], self.exp_avg_sq[g])
        self.prefetch()
        groups, copied = self._fetched
        copied.wait_stream()
        return groups[g]

    def host_values(self):
        """The values on the host (fp32), for writing them back into the masters."""
        self._home_copy.synchronize()
        return [v.to("cpu") for v in self.values]

    def state(self):
        """Moments and step count, for a checkpoint (host tensors)."""
        self._home_copy.synchronize()
        return dict(exp_avg=[t.to("cpu") for t in self.exp_avg],
                    exp_avg_sq=[t.to("cpu") for t in self.exp_avg_sq],
                    steps=self.steps)
