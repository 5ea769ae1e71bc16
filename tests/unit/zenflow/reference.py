# SPDX-License-Identifier: Apache-2.0
"""A plain-torch model of the ZenFlow algorithm (whole tensors, no partitions, buffers or threads), to test against.

The algorithm as upstream DeepSpeed defines it (``deepspeed/runtime/zenflow`` and
``zenflow_stage_1_and_2.py`` of 0.19.8), per ZenFlow step ``t``, which is one ``engine.step()``
(one micro-batch: the host window takes the place of gradient accumulation), with ``g_t`` the mean
over ranks of the micro-batch's gradient and ``W`` warm-up rounds:

* ``t < W``: one Adam step of everything on the host (clipped by ``g_t``'s norm);
* selection at ``t = W`` and at every ``t`` that is a multiple of ``select_every``: the top
  ``max(1, int(topk * C))`` columns ``W[:, j]`` of every weight of ``C = numel / rows`` columns by
  the L1 norm of ``g_t``'s column; parameters of fewer than two dimensions are always selected.
  The pending host step is applied first; the selected values are read from the host master
  ``X`` (which holds the device values of the previous selection, written back); the device
  moments and step count start at zero;
* every step, the selected elements take one Adam step with ``c_t g_t`` on the device
  (``c_t = min(1, clip / (|g_t| + 1e-6))``), and ``c_t g_t`` is added into the window;
* the window closes at ``t`` when ``(t + 1 - W) % update_every == 0``, or when ``t + 1`` selects;
  then the host Adam steps ``X`` with the window's mean (``window_update``: one plain step,
  ``scaled``/``sqrt`` learning rate, or ``repeat``), its bias correction counting host steps;
  the values reach ``Q``, the model, at once, or with ``overlap`` when the next window closes
  (``apply_after``: that many steps after the launch), or at the next selection;
* ``Q`` holds the device values for the selected elements.

Deliberate differences from upstream's code, each one of its errors (docs/compatibility.md): the
device part is clipped like the host part; the device step count restarts with its moments at a
selection; the host bias correction counts host steps, with one set of moments; a selection
writes the device values back into the fp32 masters after applying a pending host step; the
selection does not depend on how the weights are partitioned.
"""

import math

import torch
from torch.optim.adam import adam as functional_adam


def adam_(param, grad, exp_avg, exp_avg_sq, step, hp):
    """One torch Adam(W) step of ``param`` with the step count ``step`` (1 for the first)."""
    functional_adam([param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step - 1))],
                    foreach=False,
                    capturable=False,
                    differentiable=False,
                    has_complex=False,
                    amsgrad=False,
                    maximize=False,
                    decoupled_weight_decay=True,
                    **hp)


def k_of(columns, topk):
    return min(columns, max(1, int(topk * columns)))


class ZenFlowReference:
    """See the module docstring. ``params``: ordered dict name -> initial tensor (taken as fp32)."""

    def __init__(self,
                 params,
                 *,
                 lr,
                 betas=(0.9, 0.999),
                 eps=1e-8,
                 weight_decay=0.0,
                 clip=0.0,
                 topk=0.1,
                 update_every=4,
                 select_every=None,
                 warm_up=0,
                 overlap=False,
                 auto_ratio=0.99,
                 window_update="once",
                 apply_after="window"):
        self.X = {n: p.detach().clone().float() for n, p in params.items()}
        self.Q = {n: p.clone() for n, p in self.X.items()}
        self.m_h = {n: torch.zeros_like(p) for n, p in self.X.items()}
        self.v_h = {n: torch.zeros_like(p) for n, p in self.X.items()}
        self.host_steps = 0
        self.hp = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
        self.clip, self.topk = clip, topk
        self.update_every, self.select_every, self.warm_up = update_every, select_every, warm_up
        self.overlap, self.auto_ratio = overlap, auto_ratio
        self.window_update, self.apply_after = window_update, apply_after
        self.cols = {}  # name -> selected columns (selectable parameters)
        self.dev = {}  # name -> (values, exp_avg, exp_avg_sq), the selected elements as 2-D (rows, k) or flat
        self.dev_steps = 0
        self.acc, self.count = {}, 0
        self.pending, self.launched_at = False, None
        self.t = 0
        self.selected = False
        self.auto = None
        self.last_norm = None

    @classmethod
    def from_config(cls, params, zenflow, **adam):
        """The reference a ``zero_optimization.zenflow`` section ``zenflow`` describes (its keys at the config's
        defaults where left out; ``"auto"`` intervals as None); ``adam``: ``lr``, ``eps``, ``weight_decay``,
        ``clip``."""
        update = zenflow.get("update_interval", "auto")
        select = zenflow.get("select_interval", "auto")
        return cls(params,
                   topk=zenflow.get("topk_ratio", 0.1),
                   update_every=None if update == "auto" else update,
                   select_every=None if select == "auto" else select,
                   warm_up=zenflow.get("full_warm_up_rounds", 0),
                   overlap=zenflow.get("overlap_step", False),
                   auto_ratio=zenflow.get("auto_ratio", 0.99),
                   window_update=zenflow.get("window_update", "once"),
                   apply_after=zenflow.get("overlap_apply_after", "window"),
                   **adam)

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def selectable(t):
        return t.dim() >= 2 and t.numel() > 0

    def _sel(self, name, t):
        """The selected elements of ``t`` (shaped like parameter ``name``): ``(rows, k)`` or flat, as a copy."""
        if not self.selectable(t):
            return t.reshape(-1).clone()
        return t.reshape(t.shape[0], -1)[:, self.cols[name]].clone()

    def _put(self, name, target, values):
        if not self.selectable(target):
            target.copy_(values.view_as(target))
        else:
            target.view(target.shape[0], -1)[:, self.cols[name]] = values

    def _dev_into(self, target):
        for n, (values, _, _) in self.dev.items():
            self._put(n, target[n], values)

    def _host_step(self, grads, lr_scale=1.0):
        self.host_steps += 1
        hp = dict(self.hp, lr=self.hp["lr"] * lr_scale)
        for n in self.X:
            adam_(self.X[n], grads[n], self.m_h[n], self.v_h[n], self.host_steps, hp)

    def _window_step(self, mean, n_steps):
        if self.window_update == "scaled":
            self._host_step(mean, lr_scale=float(n_steps))
        elif self.window_update == "sqrt":
            self._host_step(mean, lr_scale=math.sqrt(n_steps))
        elif self.window_update == "repeat":
            for _ in range(n_steps):
                self._host_step(mean)
        else:
            self._host_step(mean)

    def _apply(self):
        for n in self.X:
            self.Q[n].copy_(self.X[n])
        self.pending = False

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, grads):
        """One ZenFlow step with ``grads`` (name -> the step's mean gradient, unclipped)."""
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        self.last_norm = norm
        coef = min(1.0, self.clip / (norm + 1e-6)) if self.clip > 0 else 1.0
        clipped = {n: g.float() * coef for n, g in grads.items()}
        t = self.t
        self.t += 1
        if t < self.warm_up:
            self._host_step(clipped)
            self._apply()
            return
        if not self.selected or (self.select_every and t % self.select_every == 0):
            self._select(grads, t)
        self.dev_steps += 1
        for n, (values, exp_avg, exp_avg_sq) in self.dev.items():
            adam_(values, self._sel(n, clipped[n]), exp_avg, exp_avg_sq, self.dev_steps, self.hp)
        closes = bool(self.select_every) and (t + 1) % self.select_every == 0
        if self.update_every:
            closes = closes or (t + 1 - self.warm_up) % self.update_every == 0
        else:
            closes = self._auto_closes(grads) or closes
        for n, g in clipped.items():
            self.acc[n] = g.clone() if self.count == 0 else self.acc[n] + g
        self.count += 1
        if closes:
            n_acc, self.count = self.count, 0
            mean = {n: a / n_acc for n, a in self.acc.items()}
            if self.overlap:
                if self.pending:
                    self._apply()
                self._window_step(mean, n_acc)
                self.pending, self.launched_at = True, t
            else:
                self._window_step(mean, n_acc)
                self._apply()
            self.auto = None
        elif self.pending and self.apply_after != "window" and t - self.launched_at >= self.apply_after:
            self._apply()
        self._dev_into(self.Q)

    def _select(self, grads, t):
        if self.pending:
            self._apply()
            self._dev_into(self.Q)  # the previous selection's columns keep their device values
        self._dev_into(self.X)  # the device values of the previous selection back into the masters
        self.cols = {}
        for n, g in grads.items():
            if self.selectable(g):
                rows = g.shape[0]
                l1 = g.float().reshape(rows, -1).abs().sum(0)
                self.cols[n] = torch.topk(l1, k_of(l1.numel(), self.topk)).indices.sort().values
        self.dev = {}
        for n, x in self.X.items():
            values = self._sel(n, x)
            self.dev[n] = (values, torch.zeros_like(values), torch.zeros_like(values))
        self.dev_steps = 0
        self.selected = True
        self.auto = None

    def _auto_closes(self, grads):
        """Per weight: the unselected mean squared gradient summed over the window against the window's mean of
        the selected mean squared gradient; closes when ``auto_ratio`` of the weights caught up."""
        if self.auto is None:
            self.auto = dict(non={}, crit={}, n=0)
        auto = self.auto
        auto["n"] += 1
        counted = caught = 0
        for n, g in grads.items():
            if not self.selectable(g):
                continue
            rows, cols = g.shape[0], g.numel() // g.shape[0]
            k = k_of(cols, self.topk)
            if k >= cols:
                continue
            total = float(torch.linalg.vector_norm(g.float(), dtype=torch.float32))**2
            selected = float(torch.linalg.vector_norm(self._sel(n, g.float()), dtype=torch.float32))**2
            auto["crit"][n] = auto["crit"].get(n, 0.0) + selected / (k * rows)
            auto["non"][n] = auto["non"].get(n, 0.0) + max(total - selected, 0.0) / ((cols - k) * rows)
            counted += 1
            if auto["non"][n] >= auto["crit"][n] / auto["n"]:
                caught += 1
        return counted == 0 or caught >= self.auto_ratio * counted

    def fp32_values(self):
        """Every parameter's current fp32 value: the device values for selected elements, ``X`` elsewhere."""
        values = {n: x.clone() for n, x in self.X.items()}
        self._dev_into(values)
        return values
