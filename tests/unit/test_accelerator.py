# SPDX-License-Identifier: Apache-2.0
"""The accelerator interface: selection, and the CPU accelerator's behaviour (no-op streams, host memory)."""

import time

import pytest
import torch

import deepspeed.accelerator.real_accelerator as real_accelerator
from deepspeed.accelerator import (DeepSpeedAccelerator, get_accelerator, is_current_accelerator_supported,
                                   set_accelerator)
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator


@pytest.fixture
def fresh_selection(monkeypatch):
    """Forget the process-wide accelerator for the test, and restore it afterwards."""
    monkeypatch.setattr(real_accelerator, "ds_accelerator", None)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    return monkeypatch


@pytest.fixture
def cpu():
    return CPU_Accelerator()


def test_default_selection_follows_cuda_availability(fresh_selection):
    expected = CUDA_Accelerator if torch.cuda.is_available() else CPU_Accelerator
    accelerator = get_accelerator()
    assert type(accelerator) is expected
    assert get_accelerator() is accelerator, "the accelerator is created once per process"
    assert is_current_accelerator_supported()


def test_env_override(fresh_selection):
    fresh_selection.setenv("DS_ACCELERATOR", "cpu")
    assert isinstance(get_accelerator(), CPU_Accelerator)


def test_env_override_rejects_unknown_or_unavailable(fresh_selection):
    fresh_selection.setenv("DS_ACCELERATOR", "tpu")
    with pytest.raises(ValueError, match="not supported"):
        get_accelerator()
    fresh_selection.setenv("DS_ACCELERATOR", "cuda")
    if torch.cuda.is_available():
        assert isinstance(get_accelerator(), CUDA_Accelerator)
    else:
        with pytest.raises(ValueError, match="cuda"):
            get_accelerator()


def test_set_accelerator(fresh_selection, cpu):
    set_accelerator(cpu)
    assert get_accelerator() is cpu


def test_interface_is_abstract_and_implemented():
    with pytest.raises(TypeError):
        DeepSpeedAccelerator()
    # Instantiation fails if any abstract method is left unimplemented; neither constructor touches the device.
    assert isinstance(CPU_Accelerator(), DeepSpeedAccelerator)
    assert isinstance(CUDA_Accelerator(), DeepSpeedAccelerator)


def test_cpu_devices(cpu):
    assert cpu._name == "cpu"
    assert cpu.device_name() == cpu.device_name(3) == cpu.current_device_name() == "cpu"
    assert torch.device(cpu.current_device_name()).type == "cpu"
    assert cpu.current_device() == 0
    assert cpu.is_available()
    assert cpu.communication_backend_name() == "gloo"
    assert cpu.is_synchronized_device() and cpu.use_host_timers()
    assert cpu.resolves_data_dependency() and cpu.handles_memory_backpressure()
    with cpu.device(0):
        cpu.set_device(0)
    cpu.synchronize()
    assert cpu.on_accelerator(torch.zeros(1))
    assert not cpu.on_accelerator(torch.zeros(1, device="meta"))


def test_cpu_device_count_follows_launcher(cpu, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert cpu.device_count() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cpu.device_count() == 4


def test_cpu_streams_and_events_are_noops(cpu):
    stream = cpu.Stream()
    with cpu.stream(stream):
        cpu.current_stream().wait_stream(stream)
    assert cpu.current_stream() is cpu.default_stream()
    start, end = cpu.Event(enable_timing=True), cpu.Event(enable_timing=True)
    with pytest.raises(RuntimeError):
        start.elapsed_time(end)
    start.record()
    time.sleep(0.05)
    end.record(stream)
    end.wait()
    end.synchronize()
    assert end.query()
    assert 40.0 <= start.elapsed_time(end) < 5000.0
    stream.wait_event(end)
    assert stream.query()


def test_cpu_rng(cpu):
    cpu.manual_seed(1234)
    first = torch.rand(4)
    state = cpu.get_rng_state()
    second = torch.rand(4)
    cpu.manual_seed_all(1234)
    torch.testing.assert_close(torch.rand(4), first)
    assert cpu.initial_seed() == 1234
    cpu.set_rng_state(state)
    torch.testing.assert_close(torch.rand(4), second)
    assert cpu.random() is torch.random


def test_cpu_memory(cpu):
    before = cpu.memory_allocated()
    assert before > 0
    cpu.reset_peak_memory_stats()
    block = torch.ones(24 * 1024 * 1024)  # 96 MiB, touched, so resident
    grown = cpu.memory_allocated() - before
    assert grown >= 64 * 1024 * 1024, f"resident size grew by {grown} bytes only"
    current = cpu.memory_allocated()  # sampled first: the peak read after it must cover it
    assert cpu.max_memory_allocated() >= current >= before
    assert cpu.memory_reserved() > 0 and cpu.max_memory_reserved() >= cpu.memory_reserved()
    stats = cpu.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= before + grown
    del block
    assert cpu.total_memory() >= cpu.available_memory() > 0
    cpu.empty_cache()


def test_cpu_pinning(cpu):
    tensor = torch.zeros(4)
    pinned = cpu.pin_memory(tensor)
    if torch.cuda.is_available():
        assert cpu.is_pinned(pinned)
    else:
        assert pinned is tensor and not cpu.is_pinned(pinned)


def test_cpu_dtypes_and_misc(cpu):
    # upstream's answers: bf16 always; fp16 where oneDNN has native float16 kernels on this CPU
    native_fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert cpu.is_bf16_supported() is True and cpu.is_fp16_supported() is native_fp16
    assert cpu.supported_dtypes() == [torch.float32] + ([torch.float16] if native_fp16 else []) + [torch.bfloat16]
    assert cpu.amp() is torch.amp
    calls = []
    cpu.lazy_call(lambda: calls.append(1))
    assert calls == [1]
    cpu.range_push("region")
    cpu.range_pop()
    from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
    assert cpu.get_op_builder("FusedAdamBuilder") is FusedAdamBuilder
    assert isinstance(cpu.create_op_builder("CPUAdamBuilder"), CPUAdamBuilder)
    assert cpu.create_op_builder("NoSuchBuilder") is None
    assert cpu.visible_devices_envs() == [] and cpu.export_envs() == []
    env = {}
    cpu.set_visible_devices_envs(env, [0, 1])
    assert env == {}
    assert cpu.get_compile_backend() == "inductor"
    cpu.set_compile_backend("eager")
    assert cpu.get_compile_backend() == "eager"
    assert cpu.create_graph() is None
    with cpu.capture_to_graph(None):
        pass


def test_cuda_accelerator_names_without_touching_the_device():
    cuda = CUDA_Accelerator()
    assert cuda.device_name() == "cuda" and cuda.device_name(1) == "cuda:1"
    assert cuda.communication_backend_name() == "nccl"
    assert not cuda.is_synchronized_device() and not cuda.use_host_timers()
    assert cuda.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"]
    env = {}
    cuda.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"}
    assert not cuda.on_accelerator(torch.zeros(1))
    assert cuda.is_bf16_supported() == (torch.cuda.is_available() and torch.cuda.is_bf16_supported())


OTHER_ACCELERATORS = [("hpu", "HPU_Accelerator", "hccl"), ("npu", "NPU_Accelerator", "hccl"),
                      ("mps", "MPS_Accelerator", "gloo"), ("xpu", "XPU_Accelerator", "xccl"),
                      ("mlu", "MLU_Accelerator", "cncl"), ("sdaa", "SDAA_Accelerator", "tccl"),
                      ("supa", "SUPA_Accelerator", "bccl"), ("klxpu", "KLXPU_Accelerator", "nccl")]


@pytest.mark.parametrize("name,class_name,backend", OTHER_ACCELERATORS)
def test_other_accelerators_construct_and_are_never_available(name, class_name, backend):
    """As upstream's on a machine without the device: the class constructs and says it is not there; using the
    device raises NotImplementedError naming it."""
    import importlib
    cls = getattr(importlib.import_module(f"deepspeed.accelerator.{name}_accelerator"), class_name)
    accel = cls()
    assert isinstance(accel, DeepSpeedAccelerator) and not accel.is_available() and accel.device_count() == 0
    assert (accel.device_name(), accel.device_name(1), accel._name) == (name, f"{name}:1", name)
    assert accel.communication_backend_name() == backend
    for use in (accel.synchronize, accel.current_device, lambda: accel.pin_memory(torch.ones(1))):
        with pytest.raises(NotImplementedError, match=class_name):
            use()


def test_unpin_memory_of_torch_pinned_memory_is_a_no_op(cpu):
    pinned = cpu.pin_memory(torch.ones(4))
    assert cpu.unpin_memory(pinned) is None and torch.equal(pinned, torch.ones(4))
