# SPDX-License-Identifier: Apache-2.0
"""Muon optimizers whose matrix step runs on whole matrices wherever the parameters are cut.

Muon's step for a matrix parameter ``p`` with gradient ``g`` and momentum ``m`` (``beta`` = ``momentum``)::

    m <- lerp(m, g, 1 - beta)                         elementwise
    u <- lerp(g, m, beta)   (Nesterov; else u <- m)   elementwise
    O <- direction(u)                                 the whole matrix: Newton-Schulz, scaled
    p <- p (1 - lr wd) - lr O                         elementwise

Only ``direction`` needs the whole matrix. :class:`MatrixOptimizer` runs the elementwise parts on whatever its
parameters are (whole tensors, or the flat fp32 master partitions of ZeRO 1-3) and hands ``u`` to its
``matrix_step``: :class:`LocalMatrices` (the default) when every parameter is a whole matrix, or the partitioned
exchange a ZeRO stage installs (:mod:`deepspeed.runtime.zero.partitions.matrix_step`), which gives each matrix to
one rank, computes its direction once there and returns every rank its pieces of ``O``.

* :class:`MuonWithAuxAdam`: upstream's config optimizer (``"optimizer": {"type": "Muon"}``). Param groups carry
  ``use_muon``; Muon groups take ``lr`` (0.02), ``momentum`` (0.95), ``weight_decay`` (0), ``ns_method``
  (``"gram"``), and ``ns_steps`` (5), ``nesterov`` (True); the others are stepped by an Adam (``lr`` 3e-4,
  ``betas`` (0.9, 0.95), ``eps`` 1e-10, ``weight_decay`` 0) that shares this optimizer's groups and state.
* :class:`PartitionedTorchMuon`: a client ``torch.optim.Muon`` on ZeRO 1-3, with torch's maths (its bfloat16
  Newton-Schulz, coefficients, ``eps``, ``ns_steps`` and ``adjust_lr_fn``) on whole matrices; it shares the
  client's param-group dicts, so schedulers built on the client keep working.

State: ``momentum_buffer`` per Muon parameter (upstream's and torch's key), in the parameter's dtype, on
``momentum_device`` when set (``zero_optimization.save_muon_momentum_buffer_in_memory`` with offloaded masters).
"""

import torch

from deepspeed.ops.muon.newton_schulz import NS_METHODS, muon_direction

MUON_GROUP_DEFAULTS = dict(lr=0.02, momentum=0.95, weight_decay=0.0, ns_method="gram", ns_steps=5, nesterov=True)
ADAM_GROUP_DEFAULTS = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)


class LocalMatrices:
    """The matrix step when every parameter the optimizer steps is a whole tensor: the direction is computed here."""

    def directions(self, optimizer, group, param, update):
        """``O`` for ``update`` (the Nesterov momentum of ``param``, same shape)."""
        if update.dim() < 2:
            raise ValueError(f"{type(optimizer).__name__}: a Muon parameter must be a matrix (ndim >= 2), got shape "
                             f"{tuple(update.shape)}; a ZeRO stage 1-3 engine installs its partitioned matrix step")
        return optimizer.direction(group, update)


class MatrixOptimizer(torch.optim.Optimizer):
    """Muon's elementwise parts around a matrix step (see the module docstring). Subclasses give
    :meth:`is_muon_group`, :meth:`direction` and the step of their other groups."""

    matrix_step = None  # None: LocalMatrices
    momentum_device = None  # None: beside each parameter

    def is_muon_group(self, group):
        raise NotImplementedError

    def direction(self, group, matrix):
        """The scaled orthogonalized update of one whole matrix (float32, ``matrix``'s shape)."""
        raise NotImplementedError

    def set_matrix_step(self, matrix_step):
        """Where :meth:`direction` runs: ``matrix_step.directions(optimizer, group, param, update)`` returns ``O``
        for ``param`` (a whole tensor or a flat partition), computing each whole matrix's direction once."""
        self.matrix_step = matrix_step

    def _momentum(self, param):
        state = self.state[param]
        device = self.momentum_device or param.device
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros(param.shape, dtype=param.dtype, device=device)
        elif buf.device != torch.device(device) or buf.dtype != param.dtype:  # loaded elsewhere
            buf = state["momentum_buffer"] = buf.to(device=device, dtype=param.dtype)
        return buf

    @torch.no_grad()
    def muon_group_step(self, group):
        """Step the Muon group ``group``: momentum, the matrix step, decay and update (see the module docstring)."""
        matrix_step = self.matrix_step or LocalMatrices()
        beta = group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            buf = self._momentum(p)
            grad = p.grad.to(device=buf.device, dtype=buf.dtype)
            buf.lerp_(grad, 1 - beta)
            # in place, as upstream: the window gradient is discarded after the step (and a partitioned matrix step
            # writes the direction over the update), so the step allocates nothing partition-sized
            update = grad.lerp_(buf, beta) if group.get("nesterov", True) else buf.clone()
            direction = matrix_step.directions(self, group, p, update)
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(direction.to(device=p.device, dtype=p.dtype), alpha=-group["lr"])


class MuonWithAuxAdam(MatrixOptimizer):
    """Muon on the groups with ``use_muon`` true, Adam on the others (upstream's class and group keys).

    ``adam_optimizer`` (a class; default ``torch.optim.AdamW``, or ``torch.optim.Adam`` without ``adam_w_mode``)
    is built over the Adam groups with ``adam_optimizer_kwargs``; it steps those very group dicts with this
    optimizer's ``state``.
    """

    def __init__(self, param_groups, adam_optimizer=None, adam_optimizer_kwargs=None, adam_w_mode=True):
        groups = []
        for group in param_groups:
            if "use_muon" not in group:
                raise ValueError("MuonWithAuxAdam: every param group needs 'use_muon' (True: Muon, False: Adam)")
            group = dict(group)
            group["params"] = list(group["params"])
            for key, value in (MUON_GROUP_DEFAULTS if group["use_muon"] else ADAM_GROUP_DEFAULTS).items():
                group.setdefault(key, value)
            if group["use_muon"]:
                check_muon_group(group)
            groups.append(group)
        super().__init__(groups, {})
        self.adam_w_mode = bool(adam_w_mode)
        self.aux_optimizer = None
        adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        if adam_groups:
            if adam_optimizer is None:
                adam_optimizer = torch.optim.AdamW if self.adam_w_mode else torch.optim.Adam
            # The Adam steps these very dicts (its defaults are added to them) with this optimizer's state.
            self.aux_optimizer = adam_optimizer(adam_groups, **(adam_optimizer_kwargs or {}))
            self.aux_optimizer.param_groups = adam_groups
            self.aux_optimizer.state = self.state

    def is_muon_group(self, group):
        return bool(group["use_muon"])

    def direction(self, group, matrix):
        return muon_direction(matrix.float(), group["ns_steps"], group["ns_method"])

    def _choose_kernel(self, group):
        """After a group's parameters moved (ZeRO points groups at partitions): the Adam's kernel choice."""
        choose = getattr(self.aux_optimizer, "_choose_kernel", None)
        if choose is not None and not group["use_muon"]:
            choose(group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self.muon_group_step(group)
        if self.aux_optimizer is not None:
            self._bind_aux()
            self.aux_optimizer.step()
        return loss

    def _bind_aux(self):
        # load_state_dict replaces the group dicts: the Adam follows this optimizer's current ones and its state
        self.aux_optimizer.param_groups = [g for g in self.param_groups if not g["use_muon"]]
        self.aux_optimizer.state = self.state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        if self.aux_optimizer is not None:
            self._bind_aux()
            for group in self.aux_optimizer.param_groups:
                self._choose_kernel(group)


def check_muon_group(group):
    if group["ns_method"] not in NS_METHODS:
        raise ValueError(f"Muon: ns_method must be one of {NS_METHODS}, got {group['ns_method']!r}")
    if int(group["ns_steps"]) < 1 or int(group["ns_steps"]) != group["ns_steps"]:
        raise ValueError(f"Muon: ns_steps must be a positive integer, got {group['ns_steps']!r}")
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"Muon: momentum must be in [0, 1), got {group['momentum']!r}")
    if group["lr"] < 0 or group["weight_decay"] < 0:
        raise ValueError(f"Muon: lr and weight_decay must be >= 0, got {group['lr']!r}, {group['weight_decay']!r}")


def _torch_adjusted_ratio(group, shape):
    from torch.optim._muon import _adjust_lr
    return _adjust_lr(1.0, group["adjust_lr_fn"], shape)


class PartitionedTorchMuon(MatrixOptimizer):
    """A client ``torch.optim.Muon`` stepped on ZeRO 1-3 partitions, with torch's maths on whole matrices.

    It holds the client's param-group dicts (the same objects) and starts from its state; every group is a Muon
    group. ``direction`` is torch's own Newton-Schulz (bfloat16) times the ratio torch's ``adjust_lr_fn`` gives the
    learning rate for the matrix's shape.
    """

    def __init__(self, client):
        if not isinstance(client, torch.optim.Muon):
            raise TypeError(f"PartitionedTorchMuon adopts a torch.optim.Muon, not {type(client).__name__}")
        self.client = client
        super().__init__(client.param_groups, client.defaults)
        self.param_groups = client.param_groups  # the very list: groups the client adds later are stepped too

    def is_muon_group(self, group):
        return True

    def direction(self, group, matrix):
        from torch.optim._muon import _zeropower_via_newtonschulz
        if matrix.dim() != 2:
            raise ValueError(f"torch.optim.Muon steps 2-D parameters; got shape {tuple(matrix.shape)}")
        ortho = _zeropower_via_newtonschulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])
        return ortho.float() * _torch_adjusted_ratio(group, matrix.shape)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self.muon_group_step(group)
        return loss
