# SPDX-License-Identifier: Apache-2.0
"""This rank's pieces of an engine's parameters: what the audit perturbs, and the gradient it reads.

For every trainable parameter the engine's ZeRO stage owns, the stage says which elements
this rank holds (``local_range``) and gives their fp32 value (``local_fp32_param``: the
master, or the parameter itself for stage 0 in fp32) and their window gradient
(``local_grad``). :class:`LocalPieces` keeps a flat view of each, so that the audit can

* move the fp32 values along a direction and back, bit for bit (from a saved copy);
* put the moved values into the model the forward reads (:meth:`LocalPieces.refresh`:
  stage 0 copies its masters into the model, stages 1-2 all-gather the partitions, stage 3
  re-casts its shards and releases the gathered units);
* measure the move the model actually sees: a 16-bit model holds ``cast(fp32 value)``, so the
  direction the forward is evaluated along is ``cast(theta + h v) - cast(theta - h v)``,
  not ``2 h v``. Comparing the loss difference with the gradient's dot product with that
  *realized* difference takes the rounding of the perturbation out of the comparison.

Pieces are grouped for the report: by optimizer param group (``name`` of the group dict,
else ``param_group_<i>``); when the engine trains a single param group, which would localise
nothing, by the module's top-level children (the first part of each parameter's name); or by
a label the caller computes from each parameter's name.
"""

from dataclasses import dataclass
from typing import Optional

import torch

_COMPILED_PREFIX = "_orig_mod."


@dataclass
class Piece:
    """This rank's elements ``[start, start + length)`` of one parameter (flat views; ``saved``: a copy)."""
    name: str
    index: int  # position in module.named_parameters(): the direction stream's parameter index
    slot: int  # position in LocalPieces.param_numel
    group: int
    numel: int  # of the whole parameter
    start: int
    length: int
    value: torch.Tensor  # fp32, a view into the stage's storage
    grad: torch.Tensor  # the window gradient's piece (accumulation dtype)
    model_dtype: torch.dtype  # what the forward sees: cast(value)
    saved: Optional[torch.Tensor] = None
    step: float = 0.0  # the move is step * v


def _clean(name):
    return name[len(_COMPILED_PREFIX):] if name.startswith(_COMPILED_PREFIX) else name


def _optimizer_groups(stage):
    """``param -> optimizer param group index`` for the stage's parameters."""
    layout = getattr(stage, "layout", None)
    if stage.stage != 0 and layout is not None:
        return {p: layout.slots[p].group for p in stage.params}
    # Stage 0: the param groups hold the parameters or, for 16-bit models, their fp32 masters.
    index = {}
    for g, param_group in enumerate(stage.optimizer.param_groups):
        for p in param_group["params"]:
            index.setdefault(id(p), g)
    return {p: index.get(id(stage.fp32_param(p)), 0) for p in stage.params}


def _top_level(name):
    return name.split(".", 1)[0]


def _flat(tensor, length, what, name):
    flat = tensor.detach().view(-1)  # a view, never a copy: the audit writes through it
    if flat.numel() < length:
        raise RuntimeError(f"the stage's {what} of {name} has {flat.numel()} elements, expected at least {length}")
    return flat.narrow(0, 0, length)


class LocalPieces:
    """See the module docstring. ``group_by``: None (optimizer param groups) or ``callable(name) -> label``."""

    def __init__(self, stage, module, group_by=None):
        self.stage = stage
        self.device = stage.device
        named = {}
        for i, (name, p) in enumerate(module.named_parameters()):
            named.setdefault(p, (i, _clean(name)))
        params = list(stage.params)
        missing = [p for p in params if p not in named]
        if missing:
            raise RuntimeError(f"{len(missing)} parameters the engine trains are not parameters of its module; the "
                               "audit names and orders parameters by module.named_parameters()")
        params.sort(key=lambda p: named[p][0])
        self.labels, group_of = self._groups(stage, params, named, group_by)
        self.numel = 0
        self.group_numel = [0] * len(self.labels)
        self.param_numel = []  # of every parameter the engine trains, in module order
        self.param_group = []  # the group of each of them
        self.pieces = []
        for slot, p in enumerate(params):
            index, name = named[p]
            numel = int(getattr(p, "ds_numel", p.numel()))
            self.param_numel.append(numel)
            self.param_group.append(group_of[p])
            self.numel += numel
            self.group_numel[group_of[p]] += numel
            start, length = stage.local_range(p)
            if length <= 0:
                continue
            value = _flat(stage.local_fp32_param(p), length, "fp32 value", name)
            if value.dtype != torch.float32:
                raise RuntimeError(f"the fp32 value of {name} is {value.dtype}")
            grad = _flat(stage.local_grad(p), length, "gradient", name)
            self.pieces.append(
                Piece(name, index, slot, group_of[p], numel, int(start), int(length), value, grad, p.dtype))

    @staticmethod
    def _groups(stage, params, named, group_by):
        if group_by is None:
            by_param = _optimizer_groups(stage)
            used = sorted({by_param[p] for p in params})
            if len(used) == 1:
                return LocalPieces._groups(stage, params, named, _top_level)
            param_groups = stage.optimizer.param_groups
            labels = []
            for g in used:
                name = param_groups[g].get("name") if g < len(param_groups) else None
                labels.append(name if isinstance(name, str) and name else f"param_group_{g}")
            position = {g: i for i, g in enumerate(used)}
            return labels, {p: position[by_param[p]] for p in params}
        if not callable(group_by):
            raise TypeError(f"group_by must be None or a callable(name) -> label, got {type(group_by).__name__}")
        labels, position, group_of = [], {}, {}
        for p in params:
            label = str(group_by(named[p][1]))
            if label not in position:
                position[label] = len(labels)
                labels.append(label)
            group_of[p] = position[label]
        return labels, group_of

    # ------------------------------------------------------------- sums
    @torch.no_grad()
    def local_sums(self):
        """``(theta^2, g^2)``: per parameter, the sums of squares of this rank's pieces of its value and gradient
        (float64, on the stage's device)."""
        theta = torch.zeros(len(self.param_numel), dtype=torch.float64, device=self.device)
        grad = torch.zeros(len(self.param_numel), dtype=torch.float64, device=self.device)
        for piece in self.pieces:
            theta[piece.slot] += piece.value.double().square().sum().to(self.device)
            grad[piece.slot] += piece.grad.double().square().sum().to(self.device)
        return theta, grad

    # ----------------------------------------------------- save / restore
    @torch.no_grad()
    def save(self):
        for piece in self.pieces:
            piece.saved = piece.value.clone()

    @torch.no_grad()
    def restore(self):
        """Put the saved values back (bit for bit); :meth:`refresh` then puts them into the model."""
        for piece in self.pieces:
            piece.value.copy_(piece.saved)

    def drop_saved(self):
        for piece in self.pieces:
            piece.saved = None

    @torch.no_grad()
    def refresh(self):
        """Make the model's parameters (what forward reads) match the fp32 values (a collective on stages 1-3)."""
        stage = self.stage
        if stage.stage == 0:
            if stage.masters is not None:
                stage.masters.copy_to_model()
        elif stage.stage in (1, 2):
            stage.all_gather_params()
        elif stage.stage == 3:
            stage.refresh_16bit()
        else:
            raise NotImplementedError(f"the gradient audit does not know ZeRO stage {stage.stage}")

    # -------------------------------------------------------------- moves
    def set_steps(self, steps):
        """``steps[i]``: the step length per unit of ``v`` of parameter ``i`` (of ``param_numel``)."""
        for piece in self.pieces:
            piece.step = float(steps[piece.slot])

    @torch.no_grad()
    def perturb(self, stream, k, sign, group=None, measure=False):
        """Set each piece (of ``group``, or all) to ``saved + sign * step * v_k``; the others are left as they are.

        With ``measure``, also return a ``[2, groups]`` float64 tensor on the stage's device: per
        group, this rank's ``<g, d>`` and ``<d, d>`` with ``d = cast(saved + step v) - cast(saved - step v)``,
        the realized central difference (the same whichever ``sign`` is written).
        """
        sums = {}
        for piece in self.pieces:
            if group is not None and piece.group != group:
                continue
            device, step = piece.value.device, piece.step
            for offset, v in stream.pieces(k, piece.index, piece.numel, piece.start, piece.length, device):
                n = v.numel()
                base = piece.saved.narrow(0, offset, n)
                plus = torch.add(base, v, alpha=step)
                minus = torch.add(base, v, alpha=-step)
                piece.value.narrow(0, offset, n).copy_(plus if sign > 0 else minus)
                if measure:
                    d = plus.to(piece.model_dtype).float() - minus.to(piece.model_dtype).float()
                    g = piece.grad.narrow(0, offset, n).float()
                    acc = sums.get(device)
                    if acc is None:
                        acc = sums[device] = torch.zeros(2, len(self.labels), dtype=torch.float64, device=device)
                    acc[0, piece.group] += torch.dot(g, d).double()
                    acc[1, piece.group] += torch.dot(d, d).double()
        if not measure:
            return None
        total = torch.zeros(2, len(self.labels), dtype=torch.float64, device=self.device)
        for acc in sums.values():
            total += acc.to(self.device)
        return total
