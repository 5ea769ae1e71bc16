# SPDX-License-Identifier: Apache-2.0
"""``CheckpointHiddenStatesOffload``: marked checkpoint inputs go to host buffers and come back, gradients unchanged.

The machine has no device memory, so the tests treat host tensors as offloadable (``_offloadable`` is the one rule
that says which tensors qualify) to run the copy out and back; the rule itself is tested as written.
"""

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from deepspeed.runtime.activation_checkpointing.offload_activations import (
    CheckpointHiddenStatesOffload, get_checkpoint_hidden_states_offloading_ctx_manager)


def _layers():
    torch.manual_seed(3)
    return torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(4))


def _run(layers, x, offload=None):
    h = x
    for layer in layers:
        if offload is not None:
            offload.mark(h)
        h = checkpoint(layer, torch.tanh(h), use_reentrant=False) if offload is None else checkpoint(
            lambda t, layer=layer: layer(torch.tanh(t)), h, use_reentrant=False)
    return h.square().sum()


def _reference(layers, x):
    """Plain torch, no checkpointing."""
    x = x.detach().clone().requires_grad_(True)
    h = x
    for layer in layers:
        h = layer(torch.tanh(h))
    h.square().sum().backward()
    return x.grad, [p.grad.clone() for p in layers.parameters()]


def _offloading(**kwargs):
    offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, use_pin_memory=False, **kwargs)
    offload._offloadable = lambda t: t.numel() > 0 and 0 not in t.stride()  # host tensors stand for device ones
    return offload


@pytest.mark.parametrize("keep_last_count", [0, 1, 2])
@pytest.mark.parametrize("strided", [False, True])
def test_offloaded_inputs_come_back_and_gradients_are_plain_torch(keep_last_count, strided):
    layers = _layers()
    base = torch.randn(5, 12)
    x = (base[:, ::2] if strided else base[:, :6]).detach().requires_grad_(True)
    x_grad, grads = _reference(layers, x)
    offload = _offloading(keep_last_count=keep_last_count)
    for step in range(2):  # the second step reuses the pooled host buffers
        layers.zero_grad(set_to_none=True)
        x.grad = None
        with offload:
            loss = _run(layers, x, offload)
            assert list(offload._keep_last) == list(range(offload._next_id - keep_last_count + 1,
                                                          offload._next_id + 1))
            assert all(copy.buffer.is_contiguous() for copy in offload._tracker.values())
            loss.backward()
        torch.testing.assert_close(x.grad, x_grad)
        for got, want in zip(layers.parameters(), grads):
            torch.testing.assert_close(got.grad, want)
    stats = offload.stats
    assert stats.marked_tensors == 8 and stats.saved_tensors_seen >= 8
    assert stats.offloaded_tensors == stats.restored_tensors == 2 * (4 - keep_last_count)
    assert stats.kept_last_tensors == 2 * keep_last_count and stats.skipped_marked_tensors == 0
    assert offload._cpu_buffer_pool_count == (4 - keep_last_count) and not offload._tracker


def test_retained_graph_unpacks_the_restored_input_again():
    layers = _layers()
    x = torch.randn(5, 6, requires_grad=True)
    x_grad, _ = _reference(layers, x)
    offload = _offloading(keep_last_count=0)
    with offload:
        loss = _run(layers, x, offload)
        loss.backward(retain_graph=True)
        restored = offload.stats.restored_tensors
        x.grad = None
        loss.backward()
    assert restored == offload.stats.restored_tensors == 4
    torch.testing.assert_close(x.grad, x_grad)


def test_which_inputs_are_offloaded():
    """Host tensors, small ones and overlapping views stay (and count as skipped); unmarked ones pass through."""
    offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=64)
    meta = torch.empty(4, 8, device="meta")
    assert not offload._offloadable(torch.randn(4, 8))  # the host: no device memory to free
    assert not offload._offloadable(meta)
    layers = _layers()
    x = torch.randn(5, 6, requires_grad=True)
    x_grad, _ = _reference(layers, x)
    with offload:
        loss = _run(layers, x, offload)
        loss.backward()
    assert offload.stats.marked_tensors == offload.stats.skipped_marked_tensors == 4
    assert offload.stats.offloaded_tensors == 0
    torch.testing.assert_close(x.grad, x_grad)
    big = _offloading(keep_last_count=0)
    big.min_offload_bytes = 1 << 20
    big._offloadable = CheckpointHiddenStatesOffload._offloadable.__get__(big)
    assert not big._offloadable(torch.ones(4, 4, device="meta").expand(4, 4))


def test_settings_are_checked_and_the_context_is_not_reentrant():
    with pytest.raises(ValueError, match="keep_last_count"):
        CheckpointHiddenStatesOffload(keep_last_count=-1)
    with pytest.raises(ValueError, match="min_offload_bytes"):
        get_checkpoint_hidden_states_offloading_ctx_manager(min_offload_bytes=-1)
    offload = get_checkpoint_hidden_states_offloading_ctx_manager(use_streams=False, keep_last_count=3)
    assert offload.keep_last_count == 3
    with offload:
        with pytest.raises(RuntimeError, match="not re-entrant"):
            offload.__enter__()


def test_hf_checkpointed_layers_are_marked_inside_the_context_only():
    transformers = pytest.importorskip("transformers")
    layer_cls = getattr(transformers, "GradientCheckpointingLayer", None)
    if layer_cls is None:
        pytest.skip("this transformers has no GradientCheckpointingLayer")

    class Tiny(layer_cls):

        def forward(self, hidden_states):
            return hidden_states.sin() * hidden_states

    original = layer_cls.__call__
    layer = Tiny()
    layer.gradient_checkpointing = True
    layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    layer.train()
    x = torch.randn(4, 8, requires_grad=True)
    outer, inner = _offloading(keep_last_count=0), _offloading(keep_last_count=0)
    with outer:
        with inner:  # the innermost context marks; one wrapper for both
            layer(x).sum().backward()
        wrapped = layer_cls.__call__
        assert wrapped is not original
    assert layer_cls.__call__ is original
    assert (inner.stats.marked_tensors, inner.stats.offloaded_tensors, inner.stats.restored_tensors) == (1, 1, 1)
    assert outer.stats.marked_tensors == 0
    torch.testing.assert_close(x.grad, (x.detach().sin() + x.detach() * x.detach().cos()))
    with pytest.raises(ValueError, match="boom"):
        with outer:
            raise ValueError("boom")
    assert layer_cls.__call__ is original
