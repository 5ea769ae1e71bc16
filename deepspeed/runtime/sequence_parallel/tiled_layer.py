# SPDX-License-Identifier: Apache-2.0
"""Decoder layers whose token-wise parts run in tiles (an ALST memory tool beyond ``TiledMLP``).

Of a decoder layer only the attention core mixes tokens. Everything before it (the input norm, the query, key and
value projections, their per-head norms, the rotary embedding) and everything after it (the output projection, the
residual, the second norm, the MLP and its residual) is a function of one token at a time. Under checkpointing a
layer's recomputation keeps every activation those parts save for backward (about 38 KB per token of a
2048-wide bf16 Llama with its MLP tiled), all live while the attention's backward adds its own temporaries: that
recomputation is where a long sequence runs out of device memory.

:func:`enable_tiled_decoder_layers` rewrites the layers' forward as three calls::

    q, k, v = TiledTokenwise(pre)(hidden, cos, sin)       # keeps its inputs only
    out     = attention(q, k, v, ...)                      # the model's attention function (sdpa, flash, Ulysses)
    hidden  = TiledTokenwise(post)(out, hidden)            # keeps its inputs only

so a layer keeps its input, the attention's ``q, k, v`` and output and nothing else (14 KB per token for the shape
above); each token-wise part reruns in backward one tile at a time, its transient memory one tile's. The
arithmetic is the layer's own, called through its own submodules (their hooks run, so ZeRO-3 gathers what it
released): the outputs are those of the untiled layer, and the gradients are too, up to the order in which the
parameter gradients of the tiles are summed. The parameters of a part get their gradients once per backward, as
for ``TiledMLP``.

The rewrite applies to layers with the Llama structure (``input_layernorm``, ``self_attn`` with ``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, ``post_attention_layernorm``, ``mlp``): Llama, Mistral, Qwen2 and Qwen3
(whose ``q_norm`` and ``k_norm`` join the first part). Others raise ``NotImplementedError``. A KV cache is updated
as the layer's own forward updates it.
"""

import sys
import types
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from deepspeed.runtime.sequence_parallel.tiled_compute import _ParamGrads, _trainable

__all__ = ["TiledTokenwise", "tiled", "enable_tiled_decoder_layers", "SUPPORTED_LAYERS"]

# class name -> where the attention call takes its sliding window from (None: it takes none)
SUPPORTED_LAYERS = {
    "LlamaDecoderLayer": None,
    "MistralDecoderLayer": "config",
    "Qwen2DecoderLayer": "attention",
    "Qwen3DecoderLayer": "attention",
}


_MIN_TRANSFORMERS = "4.57"


def _tiles(seq: int, tile_tokens: int) -> List[Tuple[int, int]]:
    return [(start, min(start + tile_tokens, seq)) for start in range(0, seq, tile_tokens)]


class TiledTokenwise(torch.autograd.Function):
    """``fn(module, *inputs)`` for a function independent per token, over tiles of ``tile_tokens`` of dimension 1
    of every input (all ``[batch, seq, ...]``; an input of batch 1 broadcasts, as rotary tables do). ``fn`` returns
    a tensor or a tuple of ``[batch, tile, ...]`` tensors; the results are assembled along dimension 1.

    Forward keeps only the inputs; backward reruns ``fn`` one tile at a time with autograd. ``compute_params``: the
    trainable parameters ``fn`` uses (their gradients are summed over the tiles and delivered once); inputs get
    gradients where they require them. ``anchor``: None, or a tensor that requires a gradient, so that the
    outputs take part in autograd when only parameters do (a frozen model with adapters); see :func:`tiled`.
    """

    @staticmethod
    def forward(ctx, fn: Callable, module, tile_tokens: int, compute_params: Optional[Sequence[Tensor]], anchor,
                *inputs: Tensor):
        seq = inputs[0].shape[1]
        ctx.fn, ctx.module, ctx.bounds = fn, module, _tiles(seq, max(1, int(tile_tokens)))
        ctx.params = _trainable(compute_params) or []
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: nothing flows from it
        outputs = None
        for start, end in ctx.bounds:
            pieces = fn(module, *(t[:, start:end] for t in inputs))
            ctx.single = torch.is_tensor(pieces)
            pieces = (pieces, ) if ctx.single else tuple(pieces)
            if len(ctx.bounds) == 1:
                outputs = pieces
                break
            if outputs is None:
                outputs = tuple(
                    torch.empty((p.shape[0], seq) + tuple(p.shape[2:]), dtype=p.dtype, device=p.device)
                    for p in pieces)
            for whole, piece in zip(outputs, pieces):
                whole[:, start:end].copy_(piece)
            del pieces
        ctx.save_for_backward(*inputs)
        return outputs[0] if ctx.single else outputs

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors
        wants = list(ctx.needs_input_grad[5:])
        input_grads = [torch.empty_like(t) if want else None for t, want in zip(inputs, wants)]
        param_grads = _ParamGrads(ctx.params)
        for start, end in ctx.bounds:
            tile = [t[:, start:end].detach().requires_grad_(want) for t, want in zip(inputs, wants)]
            with torch.enable_grad():
                outs = ctx.fn(ctx.module, *tile)
            outs = (outs, ) if torch.is_tensor(outs) else tuple(outs)
            roots, root_grads = [], []
            for out, grad in zip(outs, grads):
                if grad is not None and out.requires_grad:
                    roots.append(out)
                    root_grads.append(grad[:, start:end])
            leaves = [t for t, want in zip(tile, wants) if want]
            wrt = leaves + ctx.params
            found = torch.autograd.grad(roots, wrt, root_grads, allow_unused=True) if roots and wrt else [None] * len(
                wrt)
            del outs, roots
            found = iter(found)
            for whole, want in zip(input_grads, wants):
                if want:
                    g = next(found)
                    rows = whole[:, start:end]
                    rows.copy_(g) if g is not None else rows.zero_()
            param_grads.add(list(found))
        param_grads.deliver()
        return (None, None, None, None, None) + tuple(input_grads)


def tiled(fn: Callable, module, tile_tokens: int, compute_params: Optional[Sequence[Tensor]], *inputs: Tensor):
    """``TiledTokenwise.apply`` with the anchor it needs: when no input requires a gradient but a parameter does,
    an empty tensor that requires one joins the inputs (its gradient is None)."""
    params = _trainable(compute_params) or []
    anchor = None
    if params and torch.is_grad_enabled() and not any(t.requires_grad for t in inputs):
        anchor = torch.empty(0, requires_grad=True)
    return TiledTokenwise.apply(fn, module, tile_tokens, params, anchor, *inputs)


# ----------------------------------------------------------------------------------------------- the two parts
def _rotary(layer) -> Callable:
    """The model's own ``apply_rotary_pos_emb`` (the module that defines the layer's class)."""
    return sys.modules[type(layer).__module__].apply_rotary_pos_emb


def _pre(layer, hidden: Tensor, cos: Tensor, sin: Tensor):
    """Norm, projections, per-head norms and rotary embedding of a tile: ``q, k, v`` as ``[b, t, heads, d]``."""
    attn = layer.self_attn
    h = layer.input_layernorm(hidden)
    shape = (*h.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(h).view(shape)
    k = attn.k_proj(h).view(shape)
    v = attn.v_proj(h).view(shape)
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = _rotary(layer)(q, k, cos, sin, unsqueeze_dim=2)  # heads at dimension 2 here
    return q, k, v


def _post(layer, attn_out: Tensor, hidden: Tensor) -> Tensor:
    """Output projection, residual, norm, MLP and residual of a tile."""
    h = hidden + layer.self_attn.o_proj(attn_out)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _attention_function(attn) -> Callable:
    module = sys.modules[type(attn).__module__]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    impl = attn.config._attn_implementation
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
        return ALL_ATTENTION_FUNCTIONS.get_interface(impl, module.eager_attention_forward)
    return module.eager_attention_forward if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]


def _tiled_forward(self,
                   hidden_states: Tensor,
                   attention_mask: Optional[Tensor] = None,
                   position_ids: Optional[Tensor] = None,
                   past_key_values=None,
                   use_cache: Optional[bool] = False,
                   position_embeddings: Optional[Tuple[Tensor, Tensor]] = None,
                   **kwargs):
    if position_embeddings is None:  # an older layer signature: the rotary tables are not given
        return self._ds_untiled_forward(hidden_states,
                                        attention_mask=attention_mask,
                                        position_ids=position_ids,
                                        past_key_values=past_key_values,
                                        use_cache=use_cache,
                                        position_embeddings=position_embeddings,
                                        **kwargs)
    attn = self.self_attn
    cos, sin = position_embeddings
    tile = self._ds_tile_tokens
    q, k, v = tiled(_pre, self, tile, self._ds_pre_params(), hidden_states, cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, s, d], as the layer's own
    if past_key_values is not None:  # as the layer's own forward does (a generation's cache; the new tokens tiled)
        k, v = past_key_values.update(k, v, attn.layer_idx)
    window = SUPPORTED_LAYERS[type(self).__name__]
    if window == "config":
        kwargs["sliding_window"] = getattr(attn.config, "sliding_window", None)
    elif window == "attention":
        kwargs["sliding_window"] = attn.sliding_window
    out, _ = _attention_function(attn)(attn,
                                       q,
                                       k,
                                       v,
                                       attention_mask,
                                       dropout=0.0 if not attn.training else attn.attention_dropout,
                                       scaling=attn.scaling,
                                       position_ids=position_ids,
                                       **kwargs)
    out = out.reshape(*hidden_states.shape[:-1], -1)
    return tiled(_post, self, tile, self._ds_post_params(), out, hidden_states)


def _check_structure(layer) -> None:
    attn = getattr(layer, "self_attn", None)
    names = ["input_layernorm", "post_attention_layernorm", "mlp"]
    missing = [n for n in names if not hasattr(layer, n)]
    missing += [f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
                if not hasattr(attn, n)]
    if missing:
        raise NotImplementedError(f"enable_tiled_decoder_layers: {type(layer).__name__} lacks {missing} of the "
                                  f"Llama layer structure")


def enable_tiled_decoder_layers(model: torch.nn.Module, tile_tokens: int = 8192) -> int:
    """Run every decoder layer of ``model`` (an HF Transformers model, PEFT-wrapped or not) as the module
    docstring describes, with token-wise parts in tiles of ``tile_tokens`` tokens. Returns how many layers changed;
    calling it again changes none. Raises ``NotImplementedError`` when the model has decoder layers (classes named
    ``...DecoderLayer``) none of which is of a supported class."""
    if int(tile_tokens) < 1:
        raise ValueError(f"tile_tokens must be a positive number of tokens, got {tile_tokens}")
    import transformers
    from packaging.version import Version
    if Version(transformers.__version__).release < Version(_MIN_TRANSFORMERS).release:
        raise NotImplementedError(f"enable_tiled_decoder_layers needs transformers >= {_MIN_TRANSFORMERS} (decoder "
                                  f"layers that return their hidden states as one tensor); found "
                                  f"{transformers.__version__}")
    count, unsupported = 0, set()
    for module in model.modules():
        name = type(module).__name__
        if name not in SUPPORTED_LAYERS:
            if name.endswith("DecoderLayer"):
                unsupported.add(name)
            continue
        if getattr(module, "_ds_tiled", False):
            continue
        _check_structure(module)
        attn = module.self_attn
        pre = [module.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj]
        pre += [m for m in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if m is not None]
        post = [attn.o_proj, module.post_attention_layernorm, module.mlp]
        # the parameter lists are read at each call: a PEFT adapter added later, or freezing, is seen
        module._ds_pre_params = lambda _mods=pre: [p for m in _mods for p in m.parameters()]
        module._ds_post_params = lambda _mods=post: [p for m in _mods for p in m.parameters()]
        module._ds_tile_tokens = int(tile_tokens)
        module._ds_untiled_forward = module.forward
        module.forward = types.MethodType(_tiled_forward, module)
        module._ds_tiled = True
        count += 1
    if unsupported and not count:
        raise NotImplementedError(f"enable_tiled_decoder_layers supports {sorted(SUPPORTED_LAYERS)}; this model's "
                                  f"layers are {sorted(unsupported)}")
    return count
