# SPDX-License-Identifier: Apache-2.0
"""The arithmetic of the gradient pipeline, in one place, behind one dispatch table.

Every element-wise pass the pipeline and the boundary step make over gradients and
parameters goes through a function of this module. Each has a torch implementation
(below, the reference); a native kernel (``deepspeed/ops``, built from ``csrc/``) may
replace one with :func:`use_native` once it is measured to be faster, and
``DS_GRAD_OPS=torch`` in the environment keeps the torch implementations whatever is
registered. Contracts (what holds after each call) are the same for both.

Tensors passed as lists are on one device. Factors are Python floats or 0-dim tensors
on that device (a device tensor never syncs the host). Call the functions through the
module (``grad_ops.flatten_into(...)``), never import them by name: :func:`use_native`
rebinds the module attributes.
"""

import os

import torch

__all__ = [
    "scale_accumulate", "flatten_into", "chunk_into", "partial_sq_norm", "scale_", "cast_copy", "pack_cast",
    "use_native", "implementation", "reset"
]


def _scale_accumulate(targets, grads, factor):
    """``targets[i] += factor * grads[i]`` for every ``i`` (``targets`` in the accumulation dtype)."""
    if targets:
        torch._foreach_add_(targets, grads, alpha=factor)


def _flatten_into(grads, out, factor, accumulate):
    """``out[:n] = [out[:n] +] factor * cat(g.reshape(-1) for g in grads)``; ``out[n:]`` is zeroed unless accumulating.

    ``n`` is the total number of elements of ``grads``; ``out`` is a flat tensor, possibly of
    another dtype (the bucket's).
    """
    n = sum(g.numel() for g in grads)
    head = out.narrow(0, 0, n)
    if accumulate:
        head.add_(torch.cat([g.reshape(-1) for g in grads]), alpha=factor)
    else:
        torch.cat([g.reshape(-1) for g in grads], out=head)
        if factor != 1.0:
            head.mul_(factor)
        if n < out.numel():
            out.narrow(0, n, out.numel() - n).zero_()


def _chunk_into(grads, rows, factor, accumulate):
    """Rank-major copy-in: ``rows[r]`` gets chunk ``r`` of every ``g.reshape(-1)`` (each padded to ``W`` chunks).

    ``rows`` is ``[W, C]`` with ``C`` the sum of the chunk sizes ``ceil(numel / W)`` (a zero-sized
    gradient takes one zero column, as its shard does). ``rows = [rows +] factor * that``.
    """
    world = rows.shape[0]
    dtype = grads[0].dtype
    flat = [g.reshape(-1).to(dtype) if g.numel() else g.new_zeros(1, dtype=dtype) for g in grads]
    if accumulate or factor != 1.0 or dtype != rows.dtype:
        staged = torch.empty(rows.shape, dtype=dtype, device=rows.device)
        torch._chunk_cat(flat, dim=0, num_chunks=world, out=staged)
        # The factor is applied in the accumulation dtype, never in the gradient's.
        if accumulate:
            rows.add_(staged, alpha=factor)
        else:
            rows.copy_(staged)
            if factor != 1.0:
                rows.mul_(factor)
    else:
        torch._chunk_cat(flat, dim=0, num_chunks=world, out=rows)


def _partial_sq_norm(tensors, device=None, unscale=None):
    """The sum of squares of every element of ``tensors`` as a 0-dim float32 tensor on ``device``.

    ``device`` defaults to the tensors' device; with no tensors the result is 0. A non-finite
    element makes the result non-finite (inf or nan): the overflow check reads it. With
    ``unscale`` (a float or a 0-dim tensor, e.g. ``1 / loss_scale``) every tensor is first
    multiplied by it in place, and the squares are those of the scaled values (one pass in the
    native kernel: unscale, non-finite check and norm together).
    """
    if unscale is not None:
        _scale_(tensors, unscale)
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    total = torch.stack(norms).square().sum()
    return total if device is None else total.to(device)


def _scale_(tensors, coef):
    """``t *= coef`` for every ``t`` in ``tensors`` (``coef`` a float or a 0-dim tensor)."""
    if tensors:
        torch._foreach_mul_(tensors, coef)


def _cast_copy(dsts, srcs):
    """``dsts[i].copy_(srcs[i])`` with the cast to ``dsts[i]``'s dtype, for every ``i``."""
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def _pack_cast(srcs, out):
    """``out = cat(s.reshape(-1) for s in srcs)`` cast to ``out``'s dtype (``out`` flat, exactly that long)."""
    if len(srcs) == 1:
        out.copy_(srcs[0].reshape(-1))
    else:
        torch.cat([s.reshape(-1) for s in srcs], out=out)


_TORCH = {
    "scale_accumulate": _scale_accumulate,
    "flatten_into": _flatten_into,
    "chunk_into": _chunk_into,
    "partial_sq_norm": _partial_sq_norm,
    "scale_": _scale_,
    "cast_copy": _cast_copy,
    "pack_cast": _pack_cast,
}
_impl = dict(_TORCH)

# The public names start as the torch implementations; use_native() rebinds them.
scale_accumulate = _scale_accumulate
flatten_into = _flatten_into
chunk_into = _chunk_into
partial_sq_norm = _partial_sq_norm
scale_ = _scale_
cast_copy = _cast_copy
pack_cast = _pack_cast


def use_native(name, fn):
    """Replace the implementation of ``name`` by ``fn`` (same signature and contract).

    Ignored when ``DS_GRAD_OPS=torch`` is set. Returns whether ``fn`` is now in use.
    """
    if name not in _TORCH:
        raise KeyError(f"grad_ops has no function {name!r}; known: {sorted(_TORCH)}")
    if os.environ.get("DS_GRAD_OPS", "").lower() == "torch":
        return False
    _impl[name] = fn
    globals()[name] = fn
    return True


def implementation(name):
    """The function now used for ``name`` (the torch one unless :func:`use_native` replaced it)."""
    return _impl[name]


def reset():
    """Use the torch implementations again (for tests)."""
    _impl.update(_TORCH)
    globals().update(_TORCH)
