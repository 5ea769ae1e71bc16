# SPDX-License-Identifier: Apache-2.0
"""Partial optimizer offload (``offload_optimizer.ratio < 1``): the share of the step that stays on the GPU.

``ratio`` is the share of the optimizer state offloaded to the host (upstream's meaning); the other
``1 - ratio`` of each rank's partition keeps its fp32 masters and Adam moments on the device, and the
device steps it while the host steps its own share, so the host step is shorter by that share. The
window gradient stays on the host for every element (the reduction pipeline is unchanged): a device
range's gradient is copied up for the step, in slices of :data:`SLICE` elements.

The device update is the host Adam op's arithmetic (``csrc/adam/cpu_adam.cpp``, built without
contraction into fused multiply-adds) as a sequence of torch operations, each rounded on its own, with
every scalar rounded to float32 once as the op rounds it and divisions by true division (a 0-dim device
tensor, not a host scalar, which CUDA would turn into a multiplication by its reciprocal): the same
bits as the host op for every element. Its 16-bit result is copied into the host step's targets (the
pinned upload buffers or the ZeRO-3 host shards), so everything after the step is the same as with full
offload.

The host copies of a device range (masters and moments) are stale after a device step; whoever reads
or writes them through the stage's accessors or a checkpoint calls :meth:`DeviceShare.sync_host` first,
which copies them down, and the next step uploads them again (a reader may have changed them).
"""

import torch

from deepspeed.runtime.zero.gradients.profiling import ds_range

SLICE = 1 << 25  # elements of gradient staged on the device at a time


def device_ranges(masters, ratio):
    """ZeRO-3's device ranges for ``offload_optimizer.ratio``: the last ``1 - ratio`` of each group's partition."""
    ranges = []
    if ratio < 1.0:
        for g, master in enumerate(masters):
            n = master.numel()
            host = int(round(float(ratio) * n))
            if host < n:
                ranges.append(DeviceRange(g, host, n - host))
    return ranges


class DeviceRange:
    """Elements ``[start, start + length)`` of param group ``group``'s partition, stepped on the device."""

    __slots__ = ("group", "start", "length", "master", "exp_avg", "exp_avg_sq")

    def __init__(self, group, start, length):
        self.group = group
        self.start = start
        self.length = length
        self.master = self.exp_avg = self.exp_avg_sq = None


class DeviceShare:
    """The device-resident ranges of one :class:`~deepspeed.runtime.zero.offload.offload_step.HostStep`."""

    def __init__(self, host_step, ranges, device):
        self.host_step = host_step
        self.ranges = [r for r in ranges if r.length > 0]
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.device_valid = False  # the device copies hold the current masters and moments
        self.host_valid = True  # the host copies do
        self._done = None  # event after the last device step's copies
        self.numel = sum(r.length for r in self.ranges)

    def _host_views(self, r, state):
        host = self.host_step.masters[r.group].data.narrow(0, r.start, r.length)
        return host, state["exp_avg"].narrow(0, r.start, r.length), state["exp_avg_sq"].narrow(0, r.start, r.length)

    def _upload_all(self, states):
        for r in self.ranges:
            host, m, v = self._host_views(r, states[r.group])
            if r.master is None:
                r.master = torch.empty(r.length, dtype=torch.float32, device=self.device)
                r.exp_avg = torch.empty_like(r.master)
                r.exp_avg_sq = torch.empty_like(r.master)
            r.master.copy_(host, non_blocking=True)
            r.exp_avg.copy_(m, non_blocking=True)
            r.exp_avg_sq.copy_(v, non_blocking=True)
        self.device_valid = True

    def launch(self, groups, states, scalars, grads, grad_scale):
        """Step every range on the device (on its own stream) and copy its 16-bit result into the host targets.

        ``scalars[g]`` is ``host_adam.begin_step``'s tuple for group ``g`` (the step already counted);
        ``grads[g]`` its host gradient partition.
        """
        if not self.ranges:
            return
        compute = torch.cuda.current_stream(self.device) if self.stream is not None else None
        context = torch.cuda.stream(self.stream) if self.stream is not None else _null()
        with ds_range("DS::device_share_step"), context, torch.no_grad():
            if self.stream is not None:
                self.stream.wait_stream(compute)
            if not self.device_valid:
                self._upload_all(states)
            for r in self.ranges:
                if r.group not in scalars:
                    continue
                target = self.host_step.targets[r.group]
                for offset in range(0, r.length, SLICE):
                    n = min(SLICE, r.length - offset)
                    grad = grads[r.group].narrow(0, r.start + offset, n).to(self.device, non_blocking=True)
                    p, m, v = (t.narrow(0, offset, n) for t in (r.master, r.exp_avg, r.exp_avg_sq))
                    _adam_like_host_op(p, grad, m, v, groups[r.group], scalars[r.group], grad_scale)
                    out = target.narrow(0, r.start + offset, n)
                    out.copy_(p if out.dtype == torch.float32 else p.to(out.dtype), non_blocking=True)
            self.host_valid = False
            if self.stream is not None:
                self._done = torch.cuda.Event()
                self._done.record(self.stream)

    def wait_host(self):
        """Block until the last device step's results are in the host targets."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None

    def order_after(self, stream):
        """Make ``stream`` (a device stream) wait for the last device step, without blocking the host."""
        if self._done is not None and stream is not None:
            stream.wait_event(self._done)

    @torch.no_grad()
    def sync_host(self, states):
        """Copy the device masters and moments into the host copies (before anyone reads or writes those); the
        next step uploads them again."""
        self.wait_host()
        if not self.host_valid:
            for r in self.ranges:
                host, m, v = self._host_views(r, states[r.group])
                host.copy_(r.master)
                m.copy_(r.exp_avg)
                v.copy_(r.exp_avg_sq)
            self.host_valid = True
        self.device_valid = False

    def mark_host_changed(self):
        """The host masters or moments were written (a load): the next step uploads them."""
        self.device_valid = False


class _null:

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _adam_like_host_op(p, g, m, v, group, scalars, grad_scale):
    """The host op's update of one slice, operation by operation (see the module docstring)."""
    lr, beta1, beta2, eps, weight_decay, decoupled, bias_correction1, bias_correction2_sqrt = scalars
    if grad_scale != 1.0:
        g.mul_(grad_scale)
    if not decoupled and weight_decay != 0.0:
        g.add_(p * weight_decay)
    if decoupled:
        p.mul_(1.0 - lr * weight_decay)
    t = torch.sub(g, m)
    t.mul_(1.0 - beta1)
    m.add_(t)
    v.mul_(beta2)
    t = g * (1.0 - beta2)
    t.mul_(g)
    v.add_(t)
    # CUDA's float sqrt is correctly rounded (as the host op's); torch's vectorized CPU sqrt is not always, a
    # float64 sqrt rounded to float32 is (the CPU path runs where no GPU is: the tests)
    denom = v.sqrt() if v.is_cuda else v.double().sqrt().float()
    denom.div_(torch.tensor(bias_correction2_sqrt, dtype=torch.float32, device=p.device))
    denom.add_(eps)
    t = m * (-lr / bias_correction1)
    t.div_(denom)
    p.add_(t)
