# SPDX-License-Identifier: Apache-2.0
"""Tiled computation along the sequence (the ALST memory tools): only one tile's intermediates live at a time.

``TiledMLP`` and ``SequenceTiledCompute`` run their function tile by tile without autograd in forward, keep only
the input, and in backward recompute one tile at a time with autograd, so the peak holds one tile's
intermediates (an MLP's ``4 x hidden`` activations of a long sequence are the largest tensors of a layer).
``TiledFusedLogitsLoss`` goes further for the loss head, which is the last operation of the graph: it computes
each tile's loss *and its gradients* in forward, so the ``[tokens, vocab]`` logits exist for one tile at a time and
are never recomputed.

Gradient delivery. The gradients of the function's parameters are summed over the tiles and delivered once per
backward, as one accumulation into each parameter (``torch.autograd.backward`` on the leaves, which runs inside the
enclosing backward and joins its session): the gradient pipeline sees one contribution per parameter, as for an
untiled module, and no stage has to be told to wait for the last tile. Parameters come from ``compute_params``
(trainable ones only) or, where that is None, from the module passed as ``self``. ``SequenceTiledCompute`` with
neither accumulates tile by tile through plain autograd (still exact; a parameter then contributes once per tile).

The functions work without DeepSpeed: on a model no engine owns, the delivery is an ordinary accumulation into
``.grad``.
"""

import contextlib
import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["sequence_tiled_compute", "SequenceTiledCompute", "TiledMLP", "TiledFusedLogitsLoss", "AutogradComputeMLP"]


def _trainable(params: Optional[Sequence[Tensor]], module=None) -> Optional[List[Tensor]]:
    if params is None:
        if not isinstance(module, torch.nn.Module):
            return None
        params = module.parameters()
    return [p for p in params if p.requires_grad]


def _leaf_input(t: Tensor) -> Tensor:
    """A detached copy of the graph position of ``t`` that autograd treats as a leaf of the recomputation."""
    return t.detach().requires_grad_(t.requires_grad)


_SCALE_PIECE = 1 << 22  # elements of a 16-bit tensor multiplied in float32 at a time (16 MiB)


def _scaled_into(src: Tensor, factor: Tensor, out: Tensor) -> Tensor:
    """``out = src * factor`` rounded once into ``out``'s dtype. An elementwise product of a 16-bit tensor and a
    0-dim float32 tensor on one device rounds the factor to 16 bits first: for a loss divided by a token count after
    the tiled loss, every gradient would move by up to 2**-9 (bf16), all in one direction. 16-bit tensors are
    multiplied in float32 instead, a piece at a time; ``out`` may be ``src``."""
    if src.dtype not in (torch.float16, torch.bfloat16):
        return torch.mul(src, factor, out=out)
    if not (src.is_contiguous() and out.is_contiguous()):
        return out.copy_(src.float() * factor)
    for piece, into in zip(src.view(-1).split(_SCALE_PIECE), out.view(-1).split(_SCALE_PIECE)):
        into.copy_(piece.float().mul_(factor))
    return out


class _ParamGrads:
    """The tile-summed gradients of a list of parameters, delivered once."""

    def __init__(self, params: List[Tensor]):
        self.params = params
        self.sums: List[Optional[Tensor]] = [None] * len(params)

    def add(self, grads: Sequence[Optional[Tensor]]) -> None:
        for i, g in enumerate(grads):
            if g is not None:
                self.sums[i] = g if self.sums[i] is None else self.sums[i] + g

    def scale(self, factor: Tensor) -> None:
        self.sums = [None if g is None else _scaled_into(g, factor, torch.empty_like(g)) for g in self.sums]

    def deliver(self) -> None:
        """One accumulation per parameter that received a gradient, inside the running backward."""
        pairs = [(p, g) for p, g in zip(self.params, self.sums) if g is not None]
        self.sums = [None] * len(self.params)
        if not pairs:
            return
        with _whole_shapes([p for p, g in pairs if tuple(p.shape) != tuple(g.shape)]):
            torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])


@contextlib.contextmanager
def _whole_shapes(params: List[Tensor]):
    """ZeRO-3 parameters released between forward and backward show a zero-element ``.data``; an accumulation
    into them needs their whole shape, not their values. Inside the context each such parameter carries a
    zero-stride placeholder of its whole shape (no memory, no gather); its ``.data`` is put back on exit."""
    saved = []
    try:
        for p in params:
            shape = getattr(p, "ds_shape", None)
            if shape is None:
                raise RuntimeError(f"a tiled computation's gradient of shape {tuple(p.shape)} does not match its "
                                   f"parameter")
            saved.append((p, p.data))
            p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(shape)
        yield
    finally:
        for p, data in saved:
            p.data = data


def _tile_grads(output, grad_output, tile_input: Tensor, params: List[Tensor]):
    """``(d tile_input, [d param])`` of ``<grad_output, output>``, without accumulating into ``.grad``."""
    wrt = ([tile_input] if tile_input.requires_grad else []) + params
    if not wrt:
        return None, []
    grads = torch.autograd.grad(output, wrt, grad_output, allow_unused=True)
    if tile_input.requires_grad:
        return grads[0], list(grads[1:])
    return None, list(grads)


def sequence_tiled_compute(
    fn: Callable,
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict,
    kwargs_to_pass: dict,
    grad_requiring_tensor_key: str,
    compute_params=None,
    output_unshard_dimension: int = 1,
    output_reduction: Optional[str] = "mean",
):
    """``fn(**tile_kwargs, **kwargs_to_pass)`` over ``shards`` tiles of dimension 1 of every ``kwargs_to_shard``
    value (tiles of ``ceil(seqlen / shards)``), outputs concatenated along ``output_unshard_dimension`` (0: the
    tiles' scalar outputs are stacked) and reduced by ``output_reduction`` (None, "mean" or "sum").

    Equal in value and gradients to calling ``fn`` on each tile with autograd and combining the outputs the same
    way. Only ``kwargs_to_shard[grad_requiring_tensor_key]`` gets an input gradient; parameters get theirs as the
    module docstring says.
    """
    if output_reduction not in (None, "mean", "sum"):
        raise ValueError(f"unknown output_reduction {output_reduction!r}: valid values are None, 'mean', 'sum'")
    keys_to_shard = list(kwargs_to_shard.keys())
    keys_to_pass = list(kwargs_to_pass.keys())
    return SequenceTiledCompute.apply(fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key,
                                      compute_params, output_unshard_dimension, output_reduction,
                                      *kwargs_to_shard.values(), *kwargs_to_pass.values())


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd function behind :func:`sequence_tiled_compute` (same arguments, kwargs given as key lists
    followed by the values). The forward runs twice per training step (once more under checkpointing)."""

    @staticmethod
    def forward(ctx, fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, compute_params,
                output_unshard_dimension, output_reduction, *args) -> Tensor:
        if output_reduction not in (None, "mean", "sum"):
            raise ValueError(f"unknown output_reduction {output_reduction!r}: valid values are None, 'mean', 'sum'")
        keys = list(keys_to_shard) + list(keys_to_pass)
        if len(args) != len(keys):
            raise ValueError(f"SequenceTiledCompute: {len(keys)} keys but {len(args)} values")
        if grad_requiring_tensor_key not in keys_to_shard:
            raise ValueError(f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} must be one of the sharded "
                             f"keys {list(keys_to_shard)}")
        values = dict(zip(keys, args))
        step = math.ceil(seqlen / shards)
        ctx.fn, ctx.step, ctx.n_tiles = fn, step, math.ceil(seqlen / step)
        ctx.keys_to_shard, ctx.keys_to_pass = list(keys_to_shard), list(keys_to_pass)
        ctx.key, ctx.key_index = grad_requiring_tensor_key, keys.index(grad_requiring_tensor_key)
        ctx.params = _trainable(compute_params)
        ctx.dim, ctx.reduction, ctx.n_args = output_unshard_dimension, output_reduction, len(args)
        ctx.sharded = {k: values[k] for k in keys_to_shard}
        ctx.passed = {k: values[k] for k in keys_to_pass}
        outputs = []
        for i in range(ctx.n_tiles):
            tile = {k: v[:, i * step:(i + 1) * step] for k, v in ctx.sharded.items()}
            out = fn(**tile, **ctx.passed)
            outputs.append(out.unsqueeze(0) if output_unshard_dimension == 0 else out)
        ctx.tile_sizes = [o.shape[output_unshard_dimension] for o in outputs]
        whole = torch.cat(outputs, dim=output_unshard_dimension)
        ctx.whole_shape, ctx.whole_numel = whole.shape, whole.numel()
        if output_reduction == "mean":
            return whole.mean()
        if output_reduction == "sum":
            return whole.sum()
        return whole

    @staticmethod
    def backward(ctx, *grads) -> Tuple[Optional[Tensor], ...]:
        grad = grads[0]
        if ctx.reduction is not None:
            scale = grad / ctx.whole_numel if ctx.reduction == "mean" else grad
            grad = scale.expand(ctx.whole_shape)
        tile_grads = torch.split(grad, ctx.tile_sizes, dim=ctx.dim)
        full_input = ctx.sharded[ctx.key]
        input_grads = []
        param_grads = _ParamGrads(ctx.params) if ctx.params is not None else None
        for i in range(ctx.n_tiles):
            tile = {k: v[:, i * ctx.step:(i + 1) * ctx.step] for k, v in ctx.sharded.items()}
            tile_input = _leaf_input(tile[ctx.key])
            tile[ctx.key] = tile_input
            g = tile_grads[i].squeeze(0) if ctx.dim == 0 else tile_grads[i]
            with torch.enable_grad():
                out = ctx.fn(**tile, **ctx.passed)
            if param_grads is None:
                torch.autograd.backward(out, g)  # no parameter list: plain accumulation, tile by tile
                input_grads.append(tile_input.grad)
            else:
                gx, gp = _tile_grads(out, g, tile_input, ctx.params)
                input_grads.append(gx)
                param_grads.add(gp)
        if param_grads is not None:
            param_grads.deliver()
        x_grad = None
        if full_input.requires_grad:
            pieces = [full_input[:, i * ctx.step:(i + 1) * ctx.step] for i in range(ctx.n_tiles)]
            x_grad = torch.cat([torch.zeros_like(t) if g is None else g for g, t in zip(input_grads, pieces)], dim=1)
        arg_grads = [None] * ctx.n_args
        arg_grads[ctx.key_index] = x_grad
        return (None, ) * 9 + tuple(arg_grads)


class TiledMLP(torch.autograd.Function):
    """``fn(self, x)`` over ``shards`` tiles of ``x``'s second-to-last dimension (the sequence of ``[b, s, h]``
    or ``[s, h]``), outputs concatenated the same way.

    Equal in value and gradients to ``fn(self, x)`` for a function that is independent per token (an MLP). The
    forward keeps only ``x``; the backward recomputes one tile at a time. ``compute_params``: the parameters
    ``fn`` uses (default: ``self.parameters()``).
    """

    @staticmethod
    def forward(ctx, fn, self, x, shards, compute_params=None) -> Tensor:
        ctx.fn, ctx.module, ctx.shards = fn, self, shards
        ctx.params = _trainable(compute_params, self) or []
        ctx.save_for_backward(x)
        return torch.cat([fn(self, tile) for tile in torch.chunk(x, shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, *grads) -> Tuple[Optional[Tensor], ...]:
        (x, ) = ctx.saved_tensors
        x_tiles = torch.chunk(x, ctx.shards, dim=-2)
        g_tiles = torch.split(grads[0], [t.shape[-2] for t in x_tiles], dim=-2)
        param_grads = _ParamGrads(ctx.params)
        x_grads = []
        for x_tile, g_tile in zip(x_tiles, g_tiles):
            tile_input = _leaf_input(x_tile)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, tile_input)
            gx, gp = _tile_grads(out, g_tile, tile_input, ctx.params)
            x_grads.append(gx)
            param_grads.add(gp)
        param_grads.deliver()
        x_grad = torch.cat(x_grads, dim=-2) if x.requires_grad else None
        return None, None, x_grad, None, None


class TiledFusedLogitsLoss(torch.autograd.Function):
    """A loss over ``shards`` tiles of the flattened ``[b * s]`` tokens of ``x`` (``[b, s, ...]``) and ``y``
    (``[b, s, ...]``, and ``mask`` ``[b, s]`` if not None): ``fn(self, x_tile, y_tile[, mask_tile])`` returns each
    tile's scalar loss, combined by ``output_reduction`` ("mean" of the tiles' losses, or "sum").

    For a token-weighted mean over uneven tiles or masks, let ``fn`` return the tile's *sum* and divide by the
    token count outside ("sum"). Each tile's logits and gradients are computed in forward, one tile at a time;
    the backward only scales and delivers them. The result equals, in value and gradients, evaluating ``fn`` on
    each tile with autograd.
    """

    @staticmethod
    def forward(ctx, fn, self, x, y, mask, shards, compute_params=None, output_reduction="mean") -> Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"unknown output_reduction {output_reduction!r}: valid values are 'mean', 'sum'")
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError(f"x and y must be at least 2-D [batch, seq, ...], got {tuple(x.shape)} and "
                             f"{tuple(y.shape)}")
        if x.shape[:2] != y.shape[:2]:
            raise ValueError(f"x and y must agree in [batch, seq], got {tuple(x.shape)} and {tuple(y.shape)}")
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"mask must be [batch, seq] = {tuple(x.shape[:2])}, got {tuple(mask.shape)}")
        bs, seqlen = x.shape[:2]
        needs_grad = x.requires_grad
        flat_x = x.reshape(bs * seqlen, *x.shape[2:])
        flat_y = y.reshape(bs * seqlen, *y.shape[2:])
        flat_mask = mask.reshape(-1) if mask is not None else None
        x_tiles = torch.chunk(flat_x, shards, dim=0)
        y_tiles = torch.chunk(flat_y, shards, dim=0)
        m_tiles = torch.chunk(flat_mask, shards, dim=0) if mask is not None else [None] * len(x_tiles)
        weight = 1.0 / len(x_tiles) if output_reduction == "mean" else 1.0
        params = _trainable(compute_params, self) or []
        param_grads = _ParamGrads(params)
        losses, offset = [], 0
        # each tile's input gradient goes straight into its rows: no list of tiles concatenated at the end
        x_grad = torch.empty_like(flat_x, memory_format=torch.contiguous_format) if needs_grad else None
        for x_tile, y_tile, m_tile in zip(x_tiles, y_tiles, m_tiles):
            args = (self, _leaf_input(x_tile), y_tile) + ((m_tile, ) if mask is not None else ())
            if not needs_grad:
                losses.append(fn(*args).detach())
                continue
            with torch.enable_grad():
                loss = fn(*args)
            # A backward of our own inside forward: no engine must take it for a training backward.
            from deepspeed.runtime.backward import registry
            with registry.suspended():
                gx, gp = _tile_grads(loss, torch.full_like(loss, weight), args[1], params)
            rows = x_grad.narrow(0, offset, x_tile.shape[0])
            rows.copy_(gx) if gx is not None else rows.zero_()
            offset += x_tile.shape[0]
            del gx
            param_grads.add(gp)
            losses.append(loss.detach())
        stacked = torch.stack([loss.reshape(()) for loss in losses])
        ctx.param_grads = param_grads
        ctx.x_grad = x_grad.view_as(x) if needs_grad else None
        return stacked.mean() if output_reduction == "mean" else stacked.sum()

    @staticmethod
    def backward(ctx, *grads) -> Tuple[Optional[Tensor], ...]:
        upstream = grads[0]
        ctx.param_grads.scale(upstream)
        ctx.param_grads.deliver()
        x_grad, ctx.x_grad = ctx.x_grad, None
        if x_grad is not None:  # ours alone: scaled in place
            _scaled_into(x_grad, upstream, x_grad)
        return None, None, x_grad, None, None, None, None, None


class AutogradComputeMLP(torch.autograd.Function):
    """``fn(self, x)`` without tiling, recomputed in backward: the smallest example of the pattern above."""

    @staticmethod
    def forward(ctx, fn, self, x) -> Tensor:
        ctx.fn, ctx.module = fn, self
        ctx.params = _trainable(None, self) or []
        ctx.save_for_backward(x)
        return fn(self, x)

    @staticmethod
    def backward(ctx, *grads) -> Tuple[Optional[Tensor], ...]:
        (x, ) = ctx.saved_tensors
        tile_input = _leaf_input(x)
        with torch.enable_grad():
            out = ctx.fn(ctx.module, tile_input)
        gx, gp = _tile_grads(out, grads[0], tile_input, ctx.params)
        param_grads = _ParamGrads(ctx.params)
        param_grads.add(gp)
        param_grads.deliver()
        return None, None, gx
