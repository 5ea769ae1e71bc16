# SPDX-License-Identifier: Apache-2.0
"""The host Adam op (``csrc/adam/cpu_adam.cpp``) behind ``DeepSpeedCPUAdam``.

:func:`host_adam_op` loads it (prebuilt or JIT; None with a one-line note where no C++ compiler is found,
and never when ``DS_NATIVE_CPU_ADAM=0``); :func:`native_policy` says which updates use it (by default those
that also write a bf16/fp16 copy: measured faster than torch's fused AdamW followed by the copy, while the
update alone is at parity on 16 cores, docs/performance.md). :func:`group_supported` and
:func:`tensor_supported` say which updates it takes: float32, contiguous CPU tensors in a group without
amsgrad, maximize, capturable or tensor hyperparameters; everything else stays on torch's kernels.
:func:`adam_step` runs one update, optionally writing the updated parameter's bf16/fp16 copy into ``out`` in
the same pass and scaling the gradient first (the clipping coefficient); :func:`begin_step` and :func:`step_piece`
run the same update piece by piece (the offloaded step pipelines pieces with their uploads).

The update is torch's single-tensor Adam/AdamW in float32 (same order of operations), so results agree with
``torch.optim.AdamW`` to float32 rounding; the optimizer state keeps torch's layout (``step``, ``exp_avg``,
``exp_avg_sq``), so a checkpoint does not depend on which path stepped it.
"""

import math
import os

import torch

from deepspeed.ops.native import load_op
from deepspeed.ops.op_builder import CPUAdamBuilder

_OUT_KINDS = {torch.bfloat16: 1, torch.float16: 2}


def native_policy():
    """When DeepSpeedCPUAdam uses the op, from ``DS_NATIVE_CPU_ADAM``: ``"copy"`` (unset: only for updates that
    also write a low-precision copy, where the single pass was measured faster than torch's fused AdamW plus a
    copy), ``"all"`` (``=1``: every supported update) or ``"never"`` (``=0``)."""
    return {"1": "all", "0": "never"}.get(os.environ.get("DS_NATIVE_CPU_ADAM", ""), "copy")


def host_adam_op():
    """The loaded op, or None (``DS_NATIVE_CPU_ADAM=0``, or not buildable here)."""
    if native_policy() == "never":
        return None
    return load_op(CPUAdamBuilder(), "DeepSpeedCPUAdam's step")


def group_supported(group):
    """Whether the op implements this param group's update rule."""
    scalars = (group["lr"], group["eps"], group["weight_decay"]) + tuple(group["betas"])
    return (not group["amsgrad"] and not group["maximize"] and not group.get("capturable", False)
            and not group.get("differentiable", False) and not any(torch.is_tensor(s) for s in scalars))


def _flat_cpu_fp32(tensor):
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32 and tensor.is_contiguous()


def tensor_supported(param, grad):
    """Whether the op can update ``param`` with ``grad`` (float32, contiguous, on the CPU, dense)."""
    return (_flat_cpu_fp32(param) and not grad.is_sparse and _flat_cpu_fp32(grad) and grad.numel() == param.numel())


def copy_target_supported(op, target, param):
    """Whether the op can write ``param``'s updated copy into ``target`` itself (CPU bf16/fp16, contiguous)."""
    if target is None or target.device.type != "cpu" or not target.is_contiguous():
        return False
    if target.numel() != param.numel() or target.dtype not in _OUT_KINDS:
        return False
    return target.dtype != torch.float16 or op.has_float16()


def adam_step(op, group, param, grad, state, out=None, grad_scale=1.0):
    """One Adam/AdamW update of ``param`` in place (``state['step']`` is incremented); ``out``, if given and
    accepted by :func:`copy_target_supported`, receives the updated values rounded to its dtype. The update uses
    ``grad * grad_scale`` (rounded to float32, as a separate ``grad *= grad_scale`` would) without changing ``grad``.

    Raises ValueError, before changing anything, for moments that are not float32 CPU tensors like ``param``.
    """
    scalars = begin_step(group, param, state)
    step_piece(op, group, scalars, param, grad, state, 0, param.numel(), out, grad_scale)


def begin_step(group, param, state):
    """Count one step in ``state`` and return its scalars, for :func:`step_piece` calls over pieces of ``param``.

    Stepping ``param`` piece by piece (any split, any order) gives the same bits as one :func:`adam_step`: the update
    is elementwise. Raises ValueError, before changing anything, for moments unlike ``param``.
    """
    for moment in (state["exp_avg"], state["exp_avg_sq"]):
        if not _flat_cpu_fp32(moment) or moment.numel() != param.numel():
            raise ValueError("host Adam: the moments must be contiguous float32 CPU tensors shaped like the parameter")
    state["step"] += 1
    return step_scalars(group, float(state["step"]))


def step_scalars(group, step):
    """The scalars :func:`step_piece` takes for step number ``step`` of ``group`` (what :func:`begin_step` returns
    after counting that step): compare two of them to know whether two steps use the same update."""
    beta1, beta2 = group["betas"]
    return (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
            bool(group["decoupled_weight_decay"]), 1.0 - beta1**step, math.sqrt(1.0 - beta2**step))


def step_piece(op,
               group,
               scalars,
               param,
               grad,
               state,
               start,
               length,
               out=None,
               grad_scale=1.0,
               threads=None,
               backup=None):
    """Update elements ``[start, start + length)`` of ``param`` (and its moments, and of ``out`` if given) with the
    scalars of :func:`begin_step`; ``threads``: OpenMP threads (default: torch's intra-op count).

    ``backup`` (a :class:`StepBackup` shaped like ``param``) receives the same elements of ``param``, of the moments
    and of ``out`` as they were before the update, in the op's pass where it takes them (``has_backup``), else by
    copies first: :meth:`StepBackup.restore` undoes the update bit for bit.
    """
    if length <= 0:
        return
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    in_pass = backup is not None and _op_backs_up(op)
    if backup is not None and not in_pass:  # the torch fallback: the same bits, one copy pass first
        backup.save(param, state, out, start, length)
    lr, beta1, beta2, eps, weight_decay, decoupled, bias_correction1, bias_correction2_sqrt = scalars

    def at(tensor):
        return tensor.data_ptr() + start * tensor.element_size()

    error = op.adam_step(at(param), at(grad), at(exp_avg), at(exp_avg_sq), int(length), lr, beta1, beta2, eps,
                         weight_decay, decoupled, bias_correction1, bias_correction2_sqrt,
                         0 if out is None else at(out), 0 if out is None else _OUT_KINDS[out.dtype],
                         int(threads or torch.get_num_threads()), float(grad_scale),
                         *(backup.addresses(out, start) if in_pass else (0, 0, 0, 0)))
    if error:  # the op reports a rejected argument by its message (no C++ exception crosses the extension)
        raise ValueError(error)


def _op_backs_up(op):
    has = getattr(op, "has_backup", None)
    return bool(has is not None and has())


class StepBackup:
    """Buffers for the values a step overwrites (``param``, both moments, the 16-bit copy ``out``), shaped like
    ``param``, allocated once: what a speculative step restores when it is rolled back (:func:`step_piece`)."""

    def __init__(self, param, out_dtype=None):
        numel = param.numel()
        self.param = torch.empty(numel, dtype=torch.float32)
        self.exp_avg = torch.empty(numel, dtype=torch.float32)
        self.exp_avg_sq = torch.empty(numel, dtype=torch.float32)
        self.out = torch.empty(numel, dtype=out_dtype) if out_dtype is not None else None

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in (self.param, self.exp_avg, self.exp_avg_sq, self.out)
                   if t is not None)

    def addresses(self, out, start):

        def at(tensor):
            return tensor.data_ptr() + start * tensor.element_size()

        if out is not None and (self.out is None or self.out.dtype != out.dtype):
            raise ValueError("StepBackup: no buffer for the 16-bit copy of this dtype")
        return (at(self.param), at(self.exp_avg), at(self.exp_avg_sq), at(self.out) if out is not None else 0)

    def save(self, param, state, out, start, length):
        """Copy elements ``[start, start + length)`` of what a step overwrites into the backup."""
        pairs = [(self.param, param), (self.exp_avg, state["exp_avg"]), (self.exp_avg_sq, state["exp_avg_sq"])]
        if out is not None:
            pairs.append((self.out, out))
        for dst, src in pairs:
            dst.narrow(0, start, length).copy_(src.narrow(0, start, length))

    def restore(self, param, state, out, start, length):
        """Put elements ``[start, start + length)`` back as they were before the step that saved them."""
        pairs = [(param, self.param), (state["exp_avg"], self.exp_avg), (state["exp_avg_sq"], self.exp_avg_sq)]
        if out is not None:
            pairs.append((out, self.out))
        for dst, src in pairs:
            dst.narrow(0, start, length).copy_(src.narrow(0, start, length))
