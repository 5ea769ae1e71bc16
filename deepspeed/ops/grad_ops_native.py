# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels of ``csrc/grad_ops``, registered as implementations of
``deepspeed.runtime.zero.gradients.grad_ops``.

Each wrapper below has the signature and the contract of the torch function it replaces (see ``grad_ops``), up
to rounding: the kernels compute in float32 and round once to the destination type (the torch versions round
some intermediate results, e.g. a gradient cast to the bucket's dtype before it is scaled). Lists on the CPU,
and an empty list where the torch version handles it, go to the torch implementation; CUDA tensors must be
contiguous, float32/bfloat16/float16 and on one device, or the kernel raises a clear error before launching.

:func:`register` decides which kernels replace their torch function:

* ``DS_NATIVE_GRAD_OPS=1``: every kernel; ``DS_NATIVE_GRAD_OPS=0``: none;
* unset: those in :data:`DEFAULT_NATIVE`, the ones measured faster than torch on the H200
  (docs/performance.md, "Native ops");

and ``DS_GRAD_OPS=torch`` (read by ``grad_ops.use_native``) overrides all of this. Where the op cannot be built
(no CUDA, no nvcc) nothing is registered and one line in the log says so.
"""

import os

import torch

from deepspeed.ops.native import load_op
from deepspeed.ops.op_builder import GradOpsBuilder
from deepspeed.runtime.zero.gradients import grad_ops

NAMES = ("scale_accumulate", "flatten_into", "chunk_into", "partial_sq_norm", "scale_", "cast_copy", "pack_cast")

DEFAULT_NATIVE = ()
"""The kernels registered when ``DS_NATIVE_GRAD_OPS`` is unset: none. Each kernel beats the torch function it
replaces on an H200 in isolation (``python -m benchmarks.bench_grad_ops``), but on the launch-bound model the
training step was no faster with them than without (within run-to-run noise), so the torch implementations stay
the default (docs/performance.md, "Native ops"); ``DS_NATIVE_GRAD_OPS=1`` turns every kernel on."""

_op = None  # the loaded extension, once register() or load() found it


def load():
    """The loaded op module, or None where it cannot be built here (noted once in the log)."""
    global _op
    if _op is None:
        _op = load_op(GradOpsBuilder(), "the gradient pipeline's arithmetic")
    return _op


def _on_cuda(tensor):
    return tensor.device.type == "cuda"


def _factor_args(factor):
    """A factor as the kernels take it: (float, None) or (1.0, 0-dim float32 device tensor)."""
    if torch.is_tensor(factor):
        return 1.0, factor if factor.dtype == torch.float32 else factor.float()
    return float(factor), None


def _raise_if(error):
    # The kernels report a rejected input by returning its message (no C++ exception crosses the extension).
    if error:
        raise RuntimeError(error)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(fn, what, tensors, device):
    """A clear error, raised here before the extension is entered, for an input the kernels do not take.

    The extension checks the same conditions, but formatting its message crossed a C++ ABI boundary that
    crashed on one toolchain (docs/ops.md); the inputs are checked in Python first.
    """
    for index, t in enumerate(tensors):
        if not t.is_cuda:
            raise RuntimeError(f"grad_ops.{fn}: {what}[{index}] is on {t.device}; the native kernels take CUDA "
                               f"tensors")
        if t.dtype not in _KERNEL_DTYPES:
            raise RuntimeError(f"grad_ops.{fn}: {what}[{index}] is {t.dtype}; the native kernels take float32, "
                               f"bfloat16 and float16 tensors")
        if not t.is_contiguous():
            raise RuntimeError(f"grad_ops.{fn}: {what}[{index}] is not contiguous; the native kernels take "
                               f"contiguous tensors (DS_GRAD_OPS=torch keeps the torch implementation, which takes "
                               f"any layout)")
        if t.device != device:
            raise RuntimeError(f"grad_ops.{fn}: {what}[{index}] is on {t.device} but the first tensor is on {device}")


def _check_lists(fn, *named):
    device = None
    for what, tensors in named:
        if tensors and device is None:
            device = tensors[0].device
        _check(fn, what, tensors, device)


def _check_pairs(fn, dst_name, dsts, src_name, srcs):
    for i, (d, s) in enumerate(zip(dsts, srcs)):
        if d.numel() != s.numel():
            raise RuntimeError(f"grad_ops.{fn}: {dst_name}[{i}] has {d.numel()} elements but {src_name}[{i}] has "
                               f"{s.numel()}")


def _check_total(fn, tensors, out, exact):
    total = sum(t.numel() for t in tensors)
    if total > out.numel() or (exact and total != out.numel()):
        raise RuntimeError(f"grad_ops.{fn}: the tensors hold {total} elements but out has {out.numel()}")


def _check_rows(grads, rows):
    if rows.dim() != 2 or rows.shape[0] == 0:
        raise RuntimeError(f"grad_ops.chunk_into: rows must be [world, columns], not of shape {tuple(rows.shape)}")
    world = rows.shape[0]
    total = sum(-(-g.numel() // world) if g.numel() else 1 for g in grads)
    if total != rows.shape[1]:
        raise RuntimeError(f"grad_ops.chunk_into: the chunks take {total} columns but rows has {rows.shape[1]}")


def scale_accumulate(targets, grads, factor):
    if not targets or not _on_cuda(targets[0]):
        return grad_ops._TORCH["scale_accumulate"](targets, grads, factor)
    _check_lists("scale_accumulate", ("targets", targets), ("grads", grads))
    _check_pairs("scale_accumulate", "targets", targets, "grads", grads)
    value, tensor = _factor_args(factor)
    _raise_if(_op.scale_accumulate(targets, grads, value, tensor))


def flatten_into(grads, out, factor, accumulate):
    if not _on_cuda(out):
        return grad_ops._TORCH["flatten_into"](grads, out, factor, accumulate)
    _check_lists("flatten_into", ("out", [out]), ("grads", grads))
    _check_total("flatten_into", grads, out, exact=False)
    value, tensor = _factor_args(factor)
    _raise_if(_op.flatten_into(grads, out, value, tensor, bool(accumulate)))


def chunk_into(grads, rows, factor, accumulate):
    if not grads or not _on_cuda(rows):
        return grad_ops._TORCH["chunk_into"](grads, rows, factor, accumulate)
    _check_lists("chunk_into", ("rows", [rows]), ("grads", grads))
    _check_rows(grads, rows)
    value, tensor = _factor_args(factor)
    _raise_if(_op.chunk_into(grads, rows, value, tensor, bool(accumulate)))


def partial_sq_norm(tensors, device=None, unscale=None):
    if not tensors or not _on_cuda(tensors[0]):
        return grad_ops._TORCH["partial_sq_norm"](tensors, device, unscale)
    _check_lists("partial_sq_norm", ("tensors", tensors))
    value, tensor = (1.0, None) if unscale is None else _factor_args(unscale)
    total, error = _op.partial_sq_norm(tensors, unscale is not None, value, tensor)
    _raise_if(error)
    return total if device is None else total.to(device)


def scale_(tensors, coef):
    if not tensors or not _on_cuda(tensors[0]):
        return grad_ops._TORCH["scale_"](tensors, coef)
    _check_lists("scale_", ("tensors", tensors))
    value, tensor = _factor_args(coef)
    _raise_if(_op.scale_(tensors, value, tensor))


def cast_copy(dsts, srcs):
    if not dsts or not (_on_cuda(dsts[0]) and _on_cuda(srcs[0])):
        return grad_ops._TORCH["cast_copy"](dsts, srcs)
    _check_lists("cast_copy", ("dsts", dsts), ("srcs", srcs))
    _check_pairs("cast_copy", "dsts", dsts, "srcs", srcs)
    _raise_if(_op.cast_copy(dsts, srcs))


def pack_cast(srcs, out):
    if not srcs or not (_on_cuda(out) and _on_cuda(srcs[0])):
        return grad_ops._TORCH["pack_cast"](srcs, out)
    _check_lists("pack_cast", ("out", [out]), ("srcs", srcs))
    _check_total("pack_cast", srcs, out, exact=True)
    _raise_if(_op.pack_cast(srcs, out))


WRAPPERS = {name: globals()[name] for name in NAMES}


def selected_names(environ=None):
    """The kernels :func:`register` would register under ``environ`` (default: ``os.environ``)."""
    setting = (os.environ if environ is None else environ).get("DS_NATIVE_GRAD_OPS")
    if setting == "1":
        return list(NAMES)
    if setting == "0":
        return []
    return list(DEFAULT_NATIVE)


def register(device=None, names=None):
    """Make the selected kernels (``names``, default :func:`selected_names`) ``grad_ops``' implementations.

    Does nothing for a non-CUDA ``device`` or when nothing is selected; loads (builds on first use) the op
    otherwise. Returns the names now native.
    """
    if device is not None and torch.device(device).type != "cuda":
        return []
    names = selected_names() if names is None else list(names)
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise KeyError(f"grad_ops_native has no kernel {unknown}; known: {list(NAMES)}")
    if not names or load() is None:
        return []
    return [name for name in names if grad_ops.use_native(name, WRAPPERS[name])]
