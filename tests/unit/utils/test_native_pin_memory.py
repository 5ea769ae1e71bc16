# SPDX-License-Identifier: Apache-2.0
"""``DS_PIN_MEMORY_BACKEND=native``: exact-size locked host allocations (``deepspeed.utils.pin_memory``) and the
accelerator's ``pin_memory`` / ``is_pinned`` / ``unpin_memory`` through them, against plain tensors: values and
shapes, views, explicit unpin (also after ``.data`` was rebound), release with the last view, storageless tensors."""

import gc

import pytest
import torch

from deepspeed.utils import pin_memory


@pytest.fixture
def pins():
    return pin_memory.NativePinnedMemory()


@pytest.mark.parametrize("shape,dtype", [((4, 8), torch.float32), ((7, ), torch.bfloat16), ((1, 1, 3), torch.int64),
                                         ((0, ), torch.float16)])
def test_pin_copies_values_and_shape(pins, shape, dtype):
    tensor = torch.arange(max(1, torch.Size(shape).numel()))[:torch.Size(shape).numel()].reshape(shape).to(dtype)
    pinned = pins.pin(tensor)
    assert pinned.dtype == dtype and tuple(pinned.shape) == shape and torch.equal(pinned, tensor)
    assert pinned.ds_pinned is True and pins.is_pinned(pinned)
    assert pinned.data_ptr() % 4096 == 0  # whole pages
    flat = pins.pin(tensor, match_shape=False)
    assert tuple(flat.shape) == (tensor.numel(), ) and torch.equal(flat, tensor.reshape(-1))
    empty = pins.pin_empty(tensor, (2, 3))
    assert tuple(empty.shape) == (2, 3) and empty.dtype == dtype and pins.is_pinned(empty)


def test_views_unpin_and_release(pins):
    pinned = pins.pin(torch.arange(32, dtype=torch.float32))
    begin = pinned.data_ptr()
    view = pinned.narrow(0, 8, 8)
    assert pins.is_pinned(view) and not pins.is_pinned(torch.zeros(4))
    del pinned
    gc.collect()
    assert begin in pins._ranges and float(view[0]) == 8.0  # a view keeps the allocation
    del view
    gc.collect()
    assert begin not in pins._ranges  # released with the last view, without unpin
    other = pins.pin(torch.ones(16))
    first = other.data_ptr()
    keep = other.narrow(0, 0, 1)
    other.data = torch.zeros(16)  # rebound, as offload does
    assert pins.unpin(other) is True and first not in pins._ranges
    assert not pins.is_pinned(keep) and pins.unpin(other) is False
    assert float(keep[0]) == 1.0  # the memory stays valid while a view uses it


def test_storageless_tensors_are_not_pinned(pins):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        assert pins.is_pinned(mode.from_tensor(torch.zeros(2, 8))) is False
    assert pins.is_pinned(torch.zeros(2, 8, device="meta")) is False


def test_accelerator_uses_native_pins_only_when_asked(monkeypatch):
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    monkeypatch.delenv("DS_PIN_MEMORY_BACKEND", raising=False)
    assert pin_memory.get_active_native_pinned_memory() is None
    plain = accelerator.pin_memory(tensor)
    assert not getattr(plain, "ds_pinned", False) and accelerator.unpin_memory(plain) is None
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    native = pin_memory.get_active_native_pinned_memory()
    assert native is pin_memory.get_native_pinned_memory()
    pinned = accelerator.pin_memory(tensor)
    assert pinned.ds_pinned and torch.equal(pinned, tensor) and accelerator.is_pinned(pinned)
    assert tuple(accelerator.pin_memory(tensor, match_shape=False).shape) == (12, )
    assert accelerator.unpin_memory(pinned) is True and not accelerator.is_pinned(pinned)
