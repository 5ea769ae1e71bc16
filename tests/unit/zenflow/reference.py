# SPDX-License-Identifier: Apache-2.0
"""A plain-torch model of the ZenFlow algorithm (no partitions, no buffers, no threads), to test the engine against.

It keeps, per parameter (whole tensors, fp32): the host master ``X`` and its Adam state, the
selected rows and their device values and moments, the window accumulator, and ``Q``, the
values the model computes with. :meth:`ZenFlowReference.step` applies one optimizer step to
the mean gradient of every rank's micro-batches, following the algorithm as
``deepspeed/runtime/zenflow/zenflow_step.py`` states it:

* warm-up steps update everything with one host Adam step;
* at the first step of a window, when due, the device values are written back into ``X``,
  the top ``ceil(topk * R)`` rows of each weight by squared gradient norm are selected, their
  values are read from ``X`` and their moments start at zero;
* every step, the selected elements (and every parameter of fewer than two dimensions) take one
  Adam step with ``c * g`` (bias correction counting the steps since the selection), and
  ``c * g`` is added into the window accumulator;
* when a window of ``n`` steps closes the host Adam steps every element of ``X`` with the window
  mean: one step at ``n`` times the learning rate (``window_update="scaled"``), at ``sqrt(n)``
  times ("sqrt"), ``n`` steps
  ("repeat") or one plain step ("once"); the values reach ``Q`` at once, or with ``overlap``
  ``apply_after`` steps after that close ("window": when the next window closes), at the latest
  when the next window closes (or at a selection);
* ``Q`` always holds the device values for the selected rows.
"""

import math

import torch
from torch.optim.adam import adam as functional_adam

from deepspeed.ops.adam.fused_adam import fused_kernel_available


def _adam(param, grad, exp_avg, exp_avg_sq, step, hp, fused):
    functional_adam([param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step - 1))],
                    foreach=False,
                    fused=fused,
                    capturable=False,
                    differentiable=False,
                    has_complex=False,
                    amsgrad=False,
                    maximize=False,
                    decoupled_weight_decay=True,
                    **hp)


class ZenFlowReference:
    """See the module docstring. ``params`` is an ordered dict name -> initial fp32 tensor."""

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
                 select_every=4,
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
        self.clip = clip
        self.topk = topk
        self.update_every = update_every
        self.select_every = select_every
        self.warm_up = warm_up
        self.overlap = overlap
        self.auto_ratio = auto_ratio
        self.window_update = window_update
        self.apply_after = apply_after
        self.launched_at = None
        self.rows = {}  # name -> selected rows (selectable parameters)
        self.dev = {}  # name -> (values, exp_avg, exp_avg_sq) of the selected elements
        self.dev_steps = 0
        self.acc = {}
        self.count = 0
        self.pending = False
        self.steps = 0
        self.selected_at = None
        self.auto = None
        self.host_fused = fused_kernel_available("cpu", torch.float32)
        self.last_norm = None

    # ----------------------------------------------------------- helpers
    @staticmethod
    def selectable(t):
        return t.dim() >= 2 and t.numel() > 0

    def _k(self, rows):
        return min(rows, max(1, math.ceil(self.topk * rows)))

    def _sel_view(self, name, t):
        """The selected elements of ``t`` (a tensor shaped like parameter ``name``), flattened, as a copy."""
        if not self.selectable(t):
            return t.reshape(-1).clone()
        return t.reshape(t.shape[0], -1)[self.rows[name]].reshape(-1).clone()

    def _write_sel(self, name, target, values):
        if not self.selectable(target):
            target.copy_(values.view_as(target))
            return
        rows = target.view(target.shape[0], -1)
        rows[self.rows[name]] = values.view(len(self.rows[name]), -1)

    def _host_step(self, grads, lr_scale=1.0):
        self.host_steps += 1
        hp = dict(self.hp, lr=self.hp["lr"] * lr_scale)
        for n in self.X:
            _adam(self.X[n], grads[n], self.m_h[n], self.v_h[n], self.host_steps, hp, self.host_fused)

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

    def _dev_into(self, target):
        for n, (values, _, _) in self.dev.items():
            self._write_sel(n, target[n], values)

    # -------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, grads):
        """One optimizer step with the window's mean gradient ``grads`` (name -> tensor, unclipped)."""
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        self.last_norm = norm
        coef = min(1.0, self.clip / (norm + 1e-6)) if self.clip > 0 else 1.0
        clipped = {n: g.float() * coef for n, g in grads.items()}
        if self.steps < self.warm_up:
            self._host_step(clipped)
            self._apply()
            self.steps += 1
            return
        if self.count == 0 and (self.selected_at is None or (self.select_every is not None
                                                             and self.steps - self.selected_at >= self.select_every)):
            self._select(grads)
        self.dev_steps += 1
        for n, (values, exp_avg, exp_avg_sq) in self.dev.items():
            _adam(values, self._sel_view(n, clipped[n]), exp_avg, exp_avg_sq, self.dev_steps, self.hp, False)
        closes = (self.count + 1 >= self.update_every) if self.update_every else self._auto_closes(grads)
        for n, g in clipped.items():
            self.acc[n] = g.clone() if self.count == 0 else self.acc[n] + g
        self.count += 1
        if closes:
            n_acc, self.count = self.count, 0
            mean = {n: a / n_acc if n_acc > 1 else a for n, a in self.acc.items()}
            if self.overlap:
                if self.pending:
                    self._apply()
                self._window_step(mean, n_acc)
                self.pending = True
                self.launched_at = self.steps
            else:
                self._window_step(mean, n_acc)
                self._apply()
            self.auto = None
        elif (self.pending and self.apply_after != "window" and self.steps - self.launched_at >= self.apply_after):
            self._apply()
        self._dev_into(self.Q)
        self.steps += 1

    def _select(self, grads):
        if self.pending:
            self._apply()
            self._dev_into(self.Q)
        self._dev_into(self.X)  # write back
        self.rows = {}
        for n, g in grads.items():
            if self.selectable(g):
                rows = g.shape[0]
                norms = torch.linalg.vector_norm(g.float().reshape(rows, -1), dim=1, dtype=torch.float32)**2
                self.rows[n] = torch.topk(norms, self._k(rows), sorted=False).indices.sort().values
        self.dev = {}
        for n, x in self.X.items():
            values = self._sel_view(n, x)
            self.dev[n] = (values, torch.zeros_like(values), torch.zeros_like(values))
        self.dev_steps = 0
        self.selected_at = self.steps
        self.auto = None

    def _auto_closes(self, grads):
        if self.auto is None:
            self.auto = dict(non={}, crit={}, n=0)
        auto = self.auto
        auto["n"] += 1
        counted = caught = 0
        for n, g in grads.items():
            if not self.selectable(g):
                continue
            rows = g.shape[0]
            k = self._k(rows)
            if k >= rows:
                continue
            c = g.numel() // rows
            total = float(torch.linalg.vector_norm(g.float(), dtype=torch.float32))**2
            selected = float(torch.linalg.vector_norm(self._sel_view(n, g.float()), dtype=torch.float32))**2
            auto["crit"][n] = auto["crit"].get(n, 0.0) + selected / (k * c)
            auto["non"][n] = auto["non"].get(n, 0.0) + max(total - selected, 0.0) / ((rows - k) * c)
            counted += 1
            if auto["non"][n] >= auto["crit"][n] / auto["n"]:
                caught += 1
        return counted == 0 or caught >= self.auto_ratio * counted

    def fp32_values(self):
        """The current fp32 value of every parameter: the device values for selected rows, ``X`` elsewhere."""
        values = {n: x.clone() for n, x in self.X.items()}
        self._dev_into(values)
        return values
