# SPDX-License-Identifier: Apache-2.0
"""The memory keys of activation checkpointing (``cpu_checkpointing``, ``partition_activations``,
``contiguous_memory_optimization``, ``number_checkpoints``) and its boundary keys (``synchronize_checkpoint_boundary``,
``profile``).

Reference: plain checkpointing with ``torch.utils.checkpoint`` (reentrant for ``checkpoint``, non-reentrant for
``non_reentrant_checkpoint``) on a copy of the model, the same inputs and seeds; outputs and every gradient must be
bitwise equal. That the inputs really leave the device tensors they came in is checked through the allocator's
side: the storage of the layer inputs that plain checkpointing keeps alive is freed (storage weak references
expire), and the store's counters say how many were copied out and back. The machine has no device memory, so the
offload rule (``needs_offload``: device tensors only) is patched to take host tensors, as
``test_offload_activations.py`` does.
"""

import copy

import pytest
import torch
import torch.utils.checkpoint
from torch.multiprocessing.reductions import StorageWeakRef

import deepspeed.comm as dist
import deepspeed.runtime.activation_checkpointing.checkpointing as ckpt
from deepspeed.runtime.activation_checkpointing import saved_inputs
from tests.unit.common import run_distributed


@pytest.fixture(autouse=True)
def restore_module_state():
    saved = (ckpt._configured, ckpt._mpu, dict(ckpt._options), ckpt._store)
    yield
    ckpt._configured, ckpt._mpu, ckpt._options, ckpt._store = saved


class Layer(torch.nn.Module):

    def __init__(self, width):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x, scale):
        return self.drop(torch.tanh(self.fc(x))) * scale


def _layers(seed, count, width):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(Layer(width) for _ in range(count))


def _forward(layers, x, wrap, watch=None):
    h = x
    for i, layer in enumerate(layers):
        h = wrap(layer, h, 0.5 + i)
        if watch is not None and i < len(layers) - 1:
            watch.append(StorageWeakRef(h.untyped_storage()))
    return h


def _torch_reentrant(layer, h, scale):
    return torch.utils.checkpoint.checkpoint(layer, h, scale, use_reentrant=True)


def _torch_non_reentrant(layer, h, scale):
    return torch.utils.checkpoint.checkpoint(layer, h, scale, use_reentrant=False)


def _ours(layer, h, scale):
    return ckpt.checkpoint(layer, h, scale)


def _ours_non_reentrant(layer, h, scale):
    return ckpt.non_reentrant_checkpoint(layer, h, scale)


REFERENCE = {_ours: _torch_reentrant, _ours_non_reentrant: _torch_non_reentrant}


def _compare(wrap, seed, count, width, batch):
    """Run ours and plain checkpointing; return (bitwise equal, weak refs to the layer inputs of our run)."""
    layers = _layers(seed, count, width)
    reference = copy.deepcopy(layers)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, width, generator=gen).requires_grad_(True)
    results = []
    watch = []
    for model, fn in ((layers, wrap), (reference, REFERENCE[wrap])):
        torch.manual_seed(seed + 2)
        xi = x.detach().clone().requires_grad_(True)
        out = _forward(model, xi, fn, watch if model is layers else None)
        alive = sum(not ref.expired() for ref in watch) if model is layers else None
        loss = out.square().sum()
        loss.backward()
        results.append([out.detach(), xi.grad] + [p.grad for p in model.parameters()])
        if model is layers:
            after_forward_alive = alive
    equal = all(torch.equal(a, b) for a, b in zip(*results))
    return equal, after_forward_alive


@pytest.mark.parametrize("wrap", [_ours, _ours_non_reentrant], ids=["reentrant", "non_reentrant"])
def test_cpu_checkpointing_bitwise_and_frees_inputs(monkeypatch, wrap):
    monkeypatch.setattr(saved_inputs, "needs_offload", lambda tensor: True)
    gen = torch.Generator().manual_seed(7)
    count, width, batch = 5, int(torch.randint(1, 9, (1, ), generator=gen)), 3
    ckpt.configure(None, checkpoint_in_cpu=True)
    store = ckpt.get_input_store()
    equal, alive = _compare(wrap, 11, count, width, batch)
    assert equal
    # Every layer input but the last stays on the "device" only until the next layer ran: freed by now.
    assert alive == 1
    assert store.stats.offloaded == count - 1  # the last input stays (keep_last 1): the backward needs it first
    assert store.stats.restored == count - 1

    # Plain checkpointing keeps them alive (the same measurement, so it can fail).
    ckpt.configure(None)
    _, alive_plain = _compare(wrap, 11, count, width, batch)
    assert alive_plain == count - 1


def test_host_tensors_are_not_copied():
    ckpt.configure(None, checkpoint_in_cpu=True)
    assert not saved_inputs.needs_offload(torch.zeros(2))
    equal, _ = _compare(_ours, 3, 3, 4, 2)
    assert equal and ckpt.get_input_store().stats.offloaded == 0


class _WorldMPU:
    """The model-parallel group is every rank (the layer inputs are the same on each)."""

    def get_model_parallel_group(self):
        return torch.distributed.group.WORLD

    def get_model_parallel_rank(self):
        return dist.get_rank()

    def get_model_parallel_world_size(self):
        return dist.get_world_size()


def _partitioned(cpu, contiguous, wrap_name, seed):
    wrap = {"reentrant": _ours, "non_reentrant": _ours_non_reentrant}[wrap_name]
    count = 4
    gen = torch.Generator().manual_seed(seed)
    width, batch = int(torch.randint(1, 8, (1, ), generator=gen)), int(torch.randint(1, 4, (1, ), generator=gen))
    ckpt.configure(_WorldMPU(),
                   partition_activations=True,
                   checkpoint_in_cpu=cpu,
                   contiguous_checkpointing=contiguous,
                   num_checkpoints=count if contiguous else None)
    store = ckpt.get_input_store()
    pieces = []
    original_piece = store._pack_piece

    def spy(tensor, position):
        held = original_piece(tensor, position)
        pieces.append(held.piece)
        return held

    store._pack_piece = spy
    equal, _ = _compare(wrap, seed, count, width, batch)
    world = dist.get_world_size()
    numel = batch * width
    kept = store.stats.kept_numel
    expected_kept = count * -(-numel // world) if numel >= world else 0
    devices = {p.device.type for p in pieces}
    storages = {p.untyped_storage().data_ptr() for p in pieces}
    overflow = None
    if contiguous:  # one more checkpoint than number_checkpoints before a backward
        layers = _layers(seed, count + 1, width)
        try:
            _forward(layers, torch.randn(batch, width, requires_grad=True), wrap)
        except ValueError as err:
            overflow = str(err)
    return equal, kept, expected_kept, devices, len(storages), overflow


@pytest.mark.parametrize("cpu,contiguous,wrap_name", [(False, False, "reentrant"), (True, False, "non_reentrant"),
                                                      (False, True, "reentrant")])
def test_partition_activations_world_2(cpu, contiguous, wrap_name):
    results = run_distributed(_partitioned, 2, args=(cpu, contiguous, wrap_name, 5), timeout=120)
    for equal, kept, expected_kept, devices, storages, overflow in results:
        assert equal
        assert kept == expected_kept
        if expected_kept:
            assert devices == {"cpu"}  # a host run: pieces are host tensors either way
            if contiguous:
                assert storages == 1  # every piece of input 0 lies in one block
                assert "number_checkpoints" in overflow


def test_partition_without_group_keeps_inputs():
    ckpt.configure(None, partition_activations=True)
    equal, _ = _compare(_ours, 9, 3, 5, 2)
    assert equal and ckpt.get_input_store().stats.partitioned == 0


def test_synchronize_and_profile(monkeypatch, caplog):
    from deepspeed.accelerator import get_accelerator
    calls = []
    monkeypatch.setattr(type(get_accelerator()), "synchronize", lambda self, device_index=None: calls.append(1))
    ckpt.configure(None, synchronize=True, profile=True)
    logged = []
    monkeypatch.setattr("deepspeed.utils.timer.SynchronizedWallClockTimer.log",
                        lambda self, names, *a, **k: logged.extend(names))
    ckpt._timers = None
    equal, _ = _compare(_ours, 4, 3, 4, 2)
    assert equal
    assert len(calls) >= 4 * 3  # start and end of each forward and backward, three checkpoints
    assert logged.count("fwd") == 3 and logged.count("bwd") == 3


def _through_initialize(seed):
    import deepspeed
    layers = _layers(seed, 3, 4)
    reference = copy.deepcopy(layers)

    class Model(torch.nn.Module):

        def __init__(self, layers):
            super().__init__()
            self.layers = layers

        def forward(self, x):
            return _forward(self.layers, x, _ours).square().sum()

    ckpt._configured = False
    config = {"train_micro_batch_size_per_gpu": 2, "activation_checkpointing": {"cpu_checkpointing": True}}
    engine, _, _, _ = deepspeed.initialize(model=Model(layers), config=config)
    configured = ckpt.get_config()["checkpoint_in_cpu"]
    original = saved_inputs.needs_offload
    saved_inputs.needs_offload = lambda tensor: True
    try:
        x = torch.randn(2, 4, requires_grad=True)
        torch.manual_seed(seed)
        engine.backward(engine(x))
        offloaded = ckpt.get_input_store().stats.offloaded
        grads = [p.grad.clone() for p in engine.module.parameters()]
    finally:
        saved_inputs.needs_offload = original
    torch.manual_seed(seed)
    _forward(reference, x, _torch_reentrant).square().sum().backward()
    equal = all(torch.equal(a, b.grad) for a, b in zip(grads, reference.parameters()))
    engine.destroy()
    ckpt.configure(None)  # an explicit configure() wins over a later engine's section
    engine, _, _, _ = deepspeed.initialize(model=Model(_layers(seed, 3, 4)), config=config)
    explicit_kept = not ckpt.get_config()["checkpoint_in_cpu"]
    engine.destroy()
    ckpt._configured = False
    return configured, offloaded, equal, explicit_kept


def test_config_section_through_initialize():
    (configured, offloaded, equal, explicit_kept), = run_distributed(_through_initialize, 1, args=(21, ), timeout=120)
    assert configured and offloaded == 2 and equal and explicit_kept


class _FakeStream:
    """Stands in for a device stream on the host: work is done at once, so every wait is already satisfied."""

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        event.waited = True

    def synchronize(self):
        pass


class _FakeEvent:

    def __init__(self):
        self.waited = False

    def record(self, stream):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


class _StreamAccelerator:
    """An accelerator with streams whose device memory is the host's: runs the asynchronous path's logic."""

    def __init__(self):
        self.events = []

    def is_synchronized_device(self):
        return False

    def Stream(self, device=None):
        return _FakeStream()

    def stream(self, stream):
        import contextlib
        return contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return _FakeStream()

    def Event(self):
        event = _FakeEvent()
        self.events.append(event)
        return event

    def pin_memory(self, tensor):
        return tensor


@pytest.mark.parametrize("wrap", [_ours, _ours_non_reentrant], ids=["reentrant", "non_reentrant"])
def test_asynchronous_path_logic(monkeypatch, wrap):
    """The side-stream path (copies recorded by events, the previous input prefetched in backward, host buffers
    pooled across steps) on a stand-in accelerator: bitwise gradients, every offloaded input prefetched but the
    first one restored, buffers reused by the second step."""
    accelerator = _StreamAccelerator()
    monkeypatch.setattr(saved_inputs, "get_accelerator", lambda: accelerator)
    monkeypatch.setattr(saved_inputs, "needs_offload", lambda tensor: True)
    count = 6
    ckpt.configure(None, checkpoint_in_cpu=True)
    store = ckpt.get_input_store()
    for _ in range(2):
        equal, _ = _compare(wrap, 13, count, 5, 3)
        assert equal
    # offloaded: the inputs of layers 0..count-2; the kept last one prefetches layer count-2's, each restore the one
    # before it, so all but none are copied back ahead of their use
    assert store.stats.offloaded == 2 * (count - 1) and store.stats.restored == 2 * (count - 1)
    assert store.stats.prefetched == 2 * (count - 1)
    pooled = sum(len(buffers) for buffers in store._pool.values()) + len(store._returning)
    assert 0 < pooled <= count - 1  # the second step took the first step's buffers from the pool
