# SPDX-License-Identifier: Apache-2.0
"""Activation checkpointing whose checkpointed inputs wait in host memory (an ALST memory tool).

With every decoder layer checkpointed, what a long sequence keeps on the device between forward and backward is
one hidden state per layer (``layers x tokens x hidden``), the inputs the recomputation starts from. Here those
inputs are copied to the host in forward (pinned, so the copy is asynchronous on a GPU) and copied back just before
the layer is recomputed, so the device holds one layer's input at a time.

The checkpoint is reentrant in the sense of ``torch.utils.checkpoint(use_reentrant=True)``: the recomputation runs
its own backward inside the enclosing one (it joins that backward's session, so every ZeRO stage reduces what it
produces exactly once per contribution). Unlike torch's reentrant checkpoint it takes part in autograd even when no
input requires a gradient (a frozen embedding under PEFT), through an internal anchor tensor, so the parameters
inside still get their gradients. RNG states (CPU and the inputs' devices) are replayed for the recomputation, so
dropout masks match: gradients equal those of the function without checkpointing.
"""

import functools
from typing import Any, Callable, List

import torch
import torch.utils.checkpoint as torch_checkpoint

from deepspeed.runtime.zero.offload.transfers import pinned_empty

__all__ = ["checkpoint_offloaded", "enable_checkpoint_offload"]


# Pinned host blocks come from torch's caching host allocator, which rounds every request up to a power of two:
# a layer input of 4,097 MiB would take 8 GiB. A pinned copy is therefore made of power-of-two pieces (whole pieces
# of _PIECE bytes, then the binary digits of the rest down to _FLOOR), so it takes its own size within _FLOOR.
_PIECE = 1 << 28
_FLOOR = 1 << 20


def _piece_sizes(nbytes: int) -> List[int]:
    sizes = [_PIECE] * (nbytes // _PIECE)
    rest = nbytes % _PIECE
    while rest >= _FLOOR:
        size = 1 << (rest.bit_length() - 1)
        sizes.append(size)
        rest -= size
    if rest:
        sizes.append(rest)
    return sizes


def _host_pieces(nbytes: int, pin_memory: bool = True) -> List[torch.Tensor]:
    """Empty host byte buffers of :func:`_piece_sizes` for ``nbytes``."""
    return [pinned_empty(size, torch.uint8, pin_memory) for size in _piece_sizes(nbytes)]


class _HostCopy:
    """A device tensor's value in pinned host memory, as power-of-two pieces of its bytes (copied asynchronously
    on the current stream, which every later use of the device tensor's memory follows)."""

    def __init__(self, t: torch.Tensor, pin_memory: bool = True):
        self.shape, self.dtype = t.shape, t.dtype
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        self.pieces, offset = _host_pieces(flat.numel(), pin_memory), 0
        for piece in self.pieces:
            piece.copy_(flat[offset:offset + piece.numel()], non_blocking=True)
            offset += piece.numel()

    def to(self, device, non_blocking=True) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype, device=device)
        flat, offset = out.view(-1).view(torch.uint8), 0
        for piece in self.pieces:
            flat[offset:offset + piece.numel()].copy_(piece, non_blocking=non_blocking)
            offset += piece.numel()
        return out


def _to_host(t: torch.Tensor, pin_memory: bool):
    if t.device.type == "cpu":
        return t.detach()  # already on the host: nothing to move
    if pin_memory and t.layout == torch.strided and t.numel() > 0:
        return _HostCopy(t, pin_memory=True)
    return t.detach().to("cpu")


def _recording(saved):

    def pack(t):
        if t.device.type != "meta" and t.layout == torch.strided:
            saved.add(t.untyped_storage().data_ptr())
        return t

    return pack


def _unpacked(t):
    return t


def _release_unsaved(t: torch.Tensor, kept) -> None:
    """Free the storage of ``t`` unless it is in ``kept`` (what a saved tensor of the recomputed graph or a host
    copy uses). The tensor object stays: it is a root or a leaf of the inner backward, which does not read its
    value."""
    if t.device.type == "meta" or t.layout != torch.strided:
        return
    storage = t.untyped_storage()
    if storage.nbytes() > 0 and storage.data_ptr() not in kept:
        kept.add(storage.data_ptr())  # an output listed twice, or aliasing another: freed once
        storage.resize_(0)


class _OffloadedCheckpoint(torch.autograd.Function):

    @staticmethod
    def forward(ctx, run_function, preserve_rng_state, pin_memory, anchor, *args):
        ctx.run_function, ctx.preserve_rng_state = run_function, preserve_rng_state
        ctx.tensor_index = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.plain_args = [None if torch.is_tensor(a) else a for a in args]
        ctx.devices = [args[i].device for i in ctx.tensor_index]
        ctx.input_requires_grad = [args[i].requires_grad for i in ctx.tensor_index]
        ctx.host_inputs = [_to_host(args[i], pin_memory) for i in ctx.tensor_index]
        if preserve_rng_state:
            ctx.cpu_rng = torch.get_rng_state()
            ctx.fwd_devices, ctx.fwd_device_states = torch_checkpoint.get_device_states(*args)
        outputs = run_function(*args)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.plain_args)
        inputs: List[torch.Tensor] = []
        for i, host, device, req in zip(ctx.tensor_index, ctx.host_inputs, ctx.devices, ctx.input_requires_grad):
            restored = host.to(device, non_blocking=True).requires_grad_(req)
            args[i] = restored
            inputs.append(restored)
        host_inputs, ctx.host_inputs = ctx.host_inputs, None
        rng_devices = ctx.fwd_devices if ctx.preserve_rng_state else []
        with torch.random.fork_rng(devices=rng_devices, enabled=ctx.preserve_rng_state):
            if ctx.preserve_rng_state:
                torch.set_rng_state(ctx.cpu_rng)
                torch_checkpoint.set_device_states(ctx.fwd_devices, ctx.fwd_device_states)
            saved = set()  # the storages the recomputed graph keeps for its backward
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_recording(saved), _unpacked):
                outputs = ctx.run_function(*args)
        if torch.is_tensor(outputs):
            outputs = (outputs, )
        roots, root_grads = [], []
        for out, grad in zip(outputs, grads):
            if torch.is_tensor(out) and out.requires_grad and grad is not None:
                roots.append(out)
                root_grads.append(grad)
        # The restored inputs and the recomputed outputs are only the ends of the inner backward: unless a node
        # saved them, their values are not read again, so their device memory (a hidden state each, for a decoder
        # layer) is released before the backward instead of after it.
        kept = set(saved)  # and the host copies: on the CPU a "restored" input is the host tensor itself
        kept.update(h.untyped_storage().data_ptr() for h in host_inputs
                    if torch.is_tensor(h) and h.layout == torch.strided)
        for t in inputs:
            _release_unsaved(t, kept)
        for t in roots:  # a fresh result of the recomputation only (not a leaf, a view or an in-place result)
            if t.grad_fn is not None and t._base is None and t._version == 0:
                _release_unsaved(t, kept)
        if roots:
            torch.autograd.backward(roots, root_grads)
        input_grads = [None] * len(args)
        for i, restored in zip(ctx.tensor_index, inputs):
            input_grads[i] = restored.grad if restored.requires_grad else None
        return (None, None, None, None) + tuple(input_grads)


def checkpoint_offloaded(function: Callable,
                         *args: Any,
                         pin_memory: bool = True,
                         preserve_rng_state: bool = True,
                         use_reentrant: Any = None,
                         **kwargs: Any):
    """``function(*args, **kwargs)`` with activations recomputed in backward and its tensor ``args`` kept on the
    host in between.

    ``function`` returns a tensor or a tuple (tensors and other values). Keyword arguments are closed over as they
    are (they stay where they are; put the large tensors in ``args``). ``use_reentrant`` is accepted and ignored, so
    the function can stand in for ``torch.utils.checkpoint.checkpoint`` wherever that is configured by keyword.
    Gradients reach tensor ``args`` that require them and every parameter ``function`` uses.
    """
    if kwargs:
        function = functools.partial(function, **kwargs)
    pin = bool(pin_memory) and torch.cuda.is_available()
    anchor = torch.empty(0, requires_grad=True)
    return _OffloadedCheckpoint.apply(function, preserve_rng_state, pin, anchor, *args)


def enable_checkpoint_offload(model: torch.nn.Module, pin_memory: bool = True) -> torch.nn.Module:
    """Turn on gradient checkpointing of an HF Transformers model's layers with :func:`checkpoint_offloaded`.

    Works on a ``PreTrainedModel`` or a model wrapping one (PEFT): every layer that honours ``gradient_checkpointing``
    gets the offloading checkpoint. Returns ``model``.
    """
    target = model
    for attr in ("get_base_model", ):
        if hasattr(target, attr) and not hasattr(target, "_set_gradient_checkpointing"):
            target = getattr(target, attr)()
    if not hasattr(target, "_set_gradient_checkpointing"):
        raise TypeError(f"enable_checkpoint_offload needs an HF Transformers PreTrainedModel, got "
                        f"{type(model).__name__}")
    checkpoint_fn = functools.partial(checkpoint_offloaded, pin_memory=pin_memory)
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    target._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint_fn)
    return model
