# SPDX-License-Identifier: Apache-2.0
"""What upstream DeepSpeed 0.19.8's ZenFlow (ZeRO-1/2, CPU offload) computes per ``engine.step()``, in plain torch.

A model of its behaviour, written from reading its code and checked against its runs
(``benchmarks/zenflow_probe.py --compare``: its parameters after every step, one rank, with and without
``overlap_step``), with each of its errors behind a flag so that turning them all off leaves the algorithm
``tests/unit/zenflow/reference.py`` implements (up to the points listed there). One rank: upstream selects
columns per rank-local piece at world > 1, which this model does not lay out. Per step ``i`` (every
``engine.step()``; upstream sets ``gradient_accumulation_steps = update_interval``, so each micro-batch's loss is
divided by ``n = update_interval``):

* *boundary* ``i``: ``i + 1 < W``, or ``(i + 1 - W) % n == 0``, or ``(i + 1) % select_interval == 0``;
  *selection* ``i``: ``i >= W`` and (``i == W`` or ``i % select_interval == 0``);
* at a selection (in the backward prologue): the fp32 masters are overwritten by the model's 16-bit values
  (``i != 0``), the device moments are zeroed, their step count is kept; the top ``max(1, int(k * C))`` "columns"
  by L1 norm are chosen from the reduced gradient bucket (``bucket_offset_bug``: each weight's region is located
  by summing the sizes of the weights before it only, skipping the 1-D parameters, so it is read shifted);
* ``i >= W``: the selected columns and the 1-D parameters take an AdamW step with ``g_i / n`` (unclipped) on the
  model's values, at once (not a boundary) or after the host copy (a boundary, from a snapshot taken in the
  backward);
* the host accumulates ``g_i / n``; at a boundary it clips the accumulation by its own norm and takes one Adam
  step with bias-correction count ``i + 1`` (``host_step_count_bug``); with ``overlap_step`` the two moment sets
  alternate by ``(i // n) & 1`` (``moment_sets_bug``, warm-up: ``i & 1``) and the model gets the previous
  boundary's result; the model's values (all of them, then the device part's snapshot) are the masters' copy;
* ``layout_bug``: the flat 16-bit buffers hold every 2-D weight transposed, but the model's parameters view them
  untransposed (``_update_model_bit16_weights``), so the model computes with a scrambled weight from the first
  step on, and the host's update of an element comes from another element's gradient.
"""

import math

import torch
from torch.optim.adamw import adamw


def _adamw_(p, g, m, v, step_t, hp):
    adamw([p], [g], [m], [v], [], [step_t], foreach=False, amsgrad=False, maximize=False, **hp)


def _adam_count_(p, g, m, v, t, hp):
    """Adam(W) with the explicit bias-correction count ``t`` (upstream's host op)."""
    p.mul_(1 - hp["lr"] * hp["weight_decay"])
    m.mul_(hp["beta1"]).add_(g, alpha=1 - hp["beta1"])
    v.mul_(hp["beta2"]).addcmul_(g, g, value=1 - hp["beta2"])
    denom = (v.sqrt() / math.sqrt(1 - hp["beta2"]**t)).add_(hp["eps"])
    p.addcdiv_(m, denom, value=-hp["lr"] / (1 - hp["beta1"]**t))


class UpstreamZenFlowModel:
    """See the module docstring. ``params``: name -> initial tensor; ``bucket_order``: the names in the order
    backward fills the reduce bucket (default: reversed)."""

    def __init__(self,
                 params,
                 *,
                 lr,
                 betas=(0.9, 0.999),
                 eps=1e-8,
                 weight_decay=0.0,
                 clip=0.0,
                 topk=0.1,
                 update_interval=4,
                 select_interval=0,
                 warm_up=0,
                 overlap=False,
                 bucket_order=None,
                 layout_bug=True,
                 bucket_offset_bug=True,
                 host_step_count_bug=True,
                 moment_sets_bug=True):
        self.hp = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
        self.clip, self.topk, self.n, self.si, self.W, self.overlap = clip, topk, update_interval, select_interval, \
            warm_up, overlap
        self.layout_bug, self.bucket_offset_bug = layout_bug, bucket_offset_bug
        self.host_step_count_bug, self.moment_sets_bug = host_step_count_bug, moment_sets_bug
        self.order = list(bucket_order or reversed(list(params)))
        self.M = {k: (v.t().contiguous() if v.dim() == 2 else v).detach().clone().float() for k, v in params.items()}
        self.P = {k: self._model_view(m) for k, m in self.M.items()}  # what the model computes with
        self.hm = [{k: torch.zeros_like(m) for k, m in self.M.items()} for _ in range(2)]
        self.hv = [{k: torch.zeros_like(m) for k, m in self.M.items()} for _ in range(2)]
        self.host_steps = 0
        self.sel, self.dev = {}, {}
        self.acc, self.stale, self.first_after_warm_up, self.i = None, None, True, 0

    # the two layouts: masters hold W^T (columns, rows); the model views them
    def _model_view(self, t):
        if t.dim() != 2:
            return t.clone()
        if self.layout_bug:
            return t.reshape(-1).view(t.shape[1], t.shape[0]).clone()
        return t.t().contiguous()

    def _storage(self, v):
        if v.dim() != 2:
            return v.clone()
        if self.layout_bug:
            return v.reshape(-1).view(v.shape[1], v.shape[0]).clone()
        return v.t().contiguous()

    def _boundary(self, i):
        return i + 1 < self.W or (i + 1 - self.W) % self.n == 0 or (self.si != 0 and (i + 1) % self.si == 0)

    def _selects(self, i):
        return i >= self.W and (i == self.W or (self.si != 0 and i % self.si == 0))

    def _select(self, g):
        flat = torch.cat([(g[k].t().contiguous() if g[k].dim() == 2 else g[k]).reshape(-1) for k in self.order])
        at = 0
        for k in self.order:
            gk = g[k]
            if gk.dim() != 2:
                if not self.bucket_offset_bug:
                    at += gk.numel()
                continue
            rows, cols = gk.shape
            region = flat.narrow(0, at, rows * cols).view(cols, rows)
            self.sel[k] = torch.topk(region.abs().sum(1), max(1, int(cols * self.topk))).indices.sort().values
            at += rows * cols

    def _device_step(self, g):
        for k, p in self.P.items():
            if k not in self.dev:
                shape = (p.shape[0], len(self.sel[k])) if p.dim() == 2 else p.shape
                self.dev[k] = (torch.zeros(shape), torch.zeros(shape), torch.zeros((), dtype=torch.float32))
            m, v, t = self.dev[k]
            if p.dim() == 2:
                values = p[:, self.sel[k]].clone()
                _adamw_(values, g[k][:, self.sel[k]].contiguous(), m, v, t, self.hp)
                p[:, self.sel[k]] = values
            else:
                _adamw_(p, g[k], m, v, t, self.hp)

    def _host_step(self, grads, i, s):
        self.host_steps += 1
        t = i + 1 if self.host_step_count_bug else self.host_steps
        for k in self.M:
            _adam_count_(self.M[k], grads[k], self.hm[s][k], self.hv[s][k], t, self.hp)

    @torch.no_grad()
    def step(self, grads):
        """One ``engine.step()`` with ``grads`` (name -> the micro-batch's mean gradient over ranks, at ``P``)."""
        i = self.i
        g = {k: v / self.n for k, v in grads.items()}
        if self._selects(i):
            if i != 0:
                for k in self.M:
                    self.M[k].copy_(self._storage(self.P[k]))
            for m, v, _ in self.dev.values():
                m.zero_()
                v.zero_()
            self._select(g)
        boundary = self._boundary(i)
        snapshot = None
        if i >= self.W:
            if not boundary:
                self._device_step(g)
            else:
                snapshot = {k: (p[:, self.sel[k]].clone() if p.dim() == 2 else p.clone()) for k, p in self.P.items()}
        self.acc = dict(g) if self.acc is None else {k: self.acc[k] + g[k] for k in g}
        if boundary:
            acc, self.acc = self.acc, None
            norm = math.sqrt(sum(float(a.double().pow(2).sum()) for a in acc.values()))
            coef = min(1.0, self.clip / (norm + 1e-6)) if self.clip > 0 else 1.0
            host = {k: (a.t().contiguous() if a.dim() == 2 else a) * coef for k, a in acc.items()}
            s = 0
            if self.overlap and self.moment_sets_bug:
                s = (i & 1) if i < self.W else (i // self.n) & 1
            if not self.overlap or i < self.W:
                self._host_step(host, i, s)
                self.P = {k: self._model_view(m) for k, m in self.M.items()}
            else:
                if self.first_after_warm_up:
                    self.first_after_warm_up = False
                else:
                    self.P = {k: self._model_view(m) for k, m in self.stale.items()}
                self._host_step(host, i, s)
                self.stale = {k: m.clone() for k, m in self.M.items()}
            if snapshot is not None:
                for k, p in self.P.items():
                    if p.dim() == 2:
                        p[:, self.sel[k]] = snapshot[k]
                    else:
                        p.copy_(snapshot[k])
                self._device_step(g)
        self.i += 1
