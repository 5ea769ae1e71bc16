# SPDX-License-Identifier: Apache-2.0
"""The CUDA accelerator: ``torch.cuda`` behind the accelerator interface.

Every method is a direct delegation to ``torch.cuda``; nothing here synchronises
the device unless the method's name says so.
"""

import importlib.util

import torch

from .abstract_accelerator import DeepSpeedAccelerator


class CUDA_Accelerator(DeepSpeedAccelerator):
    """NVIDIA (and ROCm, which reports itself as ``cuda``) GPUs, with NCCL for communication."""

    def __init__(self):
        super().__init__()
        self._name = "cuda"
        self._communication_backend_name = "nccl"
        self._compile_backend = "inductor"

    def is_synchronized_device(self):
        return False

    # ---- devices ---------------------------------------------------------------------------------

    def device_name(self, device_index=None):
        if device_index is None:
            return "cuda"
        return f"cuda:{device_index}"

    def device(self, device_index=None):
        return torch.cuda.device(device_index)

    def set_device(self, device_index):
        torch.cuda.set_device(device_index)

    def current_device(self):
        return torch.cuda.current_device()

    def current_device_name(self):
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self):
        return torch.cuda.device_count()

    def synchronize(self, device_index=None):
        torch.cuda.synchronize(device_index)

    def is_available(self):
        return torch.cuda.is_available()

    # ---- RNG -------------------------------------------------------------------------------------

    def random(self):
        return torch.random

    def set_rng_state(self, new_state, device_index=None):
        if device_index is None:
            torch.cuda.set_rng_state(new_state)
        else:
            torch.cuda.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index=None):
        if device_index is None:
            return torch.cuda.get_rng_state()
        return torch.cuda.get_rng_state(device_index)

    def manual_seed(self, seed):
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self):
        return torch.cuda.initial_seed()

    def default_generator(self, device_index):
        return torch.cuda.default_generators[device_index]

    # ---- streams and events ----------------------------------------------------------------------

    @property
    def Stream(self):
        return torch.cuda.Stream

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index=None):
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self):
        return torch.cuda.Event

    # ---- memory ----------------------------------------------------------------------------------

    def empty_cache(self):
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None):
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None):
        return torch.cuda.max_memory_allocated(device_index)

    def memory_reserved(self, device_index=None):
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index=None):
        return torch.cuda.max_memory_reserved(device_index)

    def memory_stats(self, device_index=None):
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index=None):
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index=None):
        if device_index is None:
            device_index = torch.cuda.current_device()
        return torch.cuda.get_device_properties(device_index).total_memory

    def available_memory(self, device_index=None):
        if device_index is None:
            device_index = torch.cuda.current_device()
        free, _ = torch.cuda.mem_get_info(device_index)
        return free

    def pin_memory(self, tensor, align_bytes=1, make_copy=True, match_shape=True):
        from deepspeed.utils.pin_memory import get_active_native_pinned_memory
        from deepspeed.utils.pin_memory_tracker import track_pinned_memory
        native = get_active_native_pinned_memory()
        if native is not None:  # DS_PIN_MEMORY_BACKEND=native: exact-size locked pages (deepspeed.utils.pin_memory)
            return native.pin(tensor, make_copy=make_copy, match_shape=match_shape)
        pinned = tensor.pin_memory()
        track_pinned_memory(pinned.untyped_storage().nbytes())
        return pinned if match_shape else pinned.reshape(-1)  # a copy is a valid allocation (make_copy=False)

    def is_pinned(self, tensor):
        from deepspeed.utils.pin_memory import get_active_native_pinned_memory
        native = get_active_native_pinned_memory()
        return (native is not None and native.is_pinned(tensor)) or tensor.is_pinned()

    def unpin_memory(self, tensor):
        from deepspeed.utils.pin_memory import get_active_native_pinned_memory
        native = get_active_native_pinned_memory()
        return native.unpin(tensor) if native is not None else None

    # ---- data types ------------------------------------------------------------------------------

    def is_bf16_supported(self):
        if not torch.cuda.is_available():
            return False
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self):
        if not torch.cuda.is_available():
            return False
        major, _ = torch.cuda.get_device_capability()
        return major >= 6

    def amp(self):
        return torch.amp

    # ---- profiling and misc ----------------------------------------------------------------------

    def range_push(self, msg):
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self):
        torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback):
        torch.cuda._lazy_call(callback)

    def is_triton_supported(self):
        if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
            return False
        major, _ = torch.cuda.get_device_capability()
        return major >= 7

    def create_graph(self):
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        return torch.cuda.graph(graph, pool, stream)

    # ---- extensions and environment --------------------------------------------------------------

    def export_envs(self):
        return ["NCCL"]

    def visible_devices_envs(self):
        return ["CUDA_VISIBLE_DEVICES"]
