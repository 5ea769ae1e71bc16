# SPDX-License-Identifier: Apache-2.0
"""The CPU accelerator: plain host processes that communicate over gloo.

The device executes synchronously, so streams and events are no-op stand-ins
(events still record host time, so timers built on them measure something
real), ``synchronize`` does nothing, and memory statistics describe the host
process (resident set size) and the machine.
"""

import contextlib
import os
import time

import torch

from .abstract_accelerator import DeepSpeedAccelerator


class CPUStream:
    """A stream that does nothing: CPU work completes in launch order, on the calling thread."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = CPUEvent() if event is None else event
        event.record(self)
        return event

    def synchronize(self):
        pass

    def query(self):
        return True


class CPUEvent:
    """An event whose waits are no-ops; ``record()`` notes the host time for ``elapsed_time``."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **kwargs):
        self.enable_timing = enable_timing
        self._time = None

    def record(self, stream=None):
        self._time = time.perf_counter()

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end_event):
        """Milliseconds between this event's and ``end_event``'s ``record()``."""
        if self._time is None or end_event._time is None:
            raise RuntimeError("elapsed_time needs both events to have been recorded")
        return (end_event._time - self._time) * 1000.0


_DEFAULT_STREAM = CPUStream()
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _resident_bytes():
    """Resident set size of this process, 0 where /proc is unavailable."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


def _meminfo_bytes(key):
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


class CPU_Accelerator(DeepSpeedAccelerator):
    """Host CPU as the device; one process per "device"; gloo for communication."""

    def __init__(self):
        super().__init__()
        self._name = "cpu"
        self._communication_backend_name = "gloo"
        self._compile_backend = "inductor"
        self._peak_resident = 0

    def is_synchronized_device(self):
        return True

    # ---- devices ---------------------------------------------------------------------------------

    def device_name(self, device_index=None):
        return "cpu"

    def device(self, device_index=None):
        return contextlib.nullcontext()

    def set_device(self, device_index):
        pass

    def current_device(self):
        return 0

    def current_device_name(self):
        return "cpu"

    def device_count(self):
        """Processes per node when a launcher says so (LOCAL_WORLD_SIZE / LOCAL_SIZE), else 1."""
        for env in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            if env in os.environ:
                return int(os.environ[env])
        return 1

    def synchronize(self, device_index=None):
        pass

    def is_available(self):
        return True

    # ---- RNG -------------------------------------------------------------------------------------

    def random(self):
        return torch.random

    def set_rng_state(self, new_state, device_index=None):
        torch.set_rng_state(new_state)

    def get_rng_state(self, device_index=None):
        return torch.get_rng_state()

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def initial_seed(self):
        return torch.initial_seed()

    def default_generator(self, device_index):
        return torch.default_generator

    # ---- streams and events ----------------------------------------------------------------------

    @property
    def Stream(self):
        return CPUStream

    def stream(self, stream):
        return contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return _DEFAULT_STREAM

    def default_stream(self, device_index=None):
        return _DEFAULT_STREAM

    @property
    def Event(self):
        return CPUEvent

    # ---- memory ----------------------------------------------------------------------------------

    def empty_cache(self):
        pass

    def memory_allocated(self, device_index=None):
        """Resident set size of this process; also updates the tracked peak."""
        resident = _resident_bytes()
        self._peak_resident = max(self._peak_resident, resident)
        return resident

    def max_memory_allocated(self, device_index=None):
        """Largest resident set size observed by this accelerator's queries since the last reset."""
        return max(self._peak_resident, self.memory_allocated())

    def memory_reserved(self, device_index=None):
        return self.memory_allocated(device_index)

    def max_memory_reserved(self, device_index=None):
        return self.max_memory_allocated(device_index)

    def memory_stats(self, device_index=None):
        current = self.memory_allocated()
        return {
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": self._peak_resident,
            "reserved_bytes.all.current": current,
            "reserved_bytes.all.peak": self._peak_resident,
        }

    def reset_peak_memory_stats(self, device_index=None):
        self._peak_resident = _resident_bytes()

    def total_memory(self, device_index=None):
        total = _meminfo_bytes("MemTotal")
        if total is None:
            total = os.sysconf("SC_PHYS_PAGES") * _PAGE_SIZE
        return total

    def available_memory(self, device_index=None):
        available = _meminfo_bytes("MemAvailable")
        if available is None:
            available = os.sysconf("SC_AVPHYS_PAGES") * _PAGE_SIZE
        return available

    def pin_memory(self, tensor, align_bytes=1, make_copy=True, match_shape=True):
        """Pinned memory only helps host-to-GPU copies: pin when a CUDA runtime exists, else return ``tensor``
        (``DS_PIN_MEMORY_BACKEND=native``: always, through ``deepspeed.utils.pin_memory``)."""
        from deepspeed.utils.pin_memory import get_active_native_pinned_memory
        native = get_active_native_pinned_memory()
        if native is not None:
            return native.pin(tensor, make_copy=make_copy, match_shape=match_shape)
        pinned = tensor
        if torch.cuda.is_available():
            from deepspeed.utils.pin_memory_tracker import track_pinned_memory
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
        return True

    def is_fp16_supported(self):
        """Upstream's answer: whether oneDNN has native float16 kernels on this CPU (AVX512-FP16 or AMX-FP16).

        Frameworks and upstream's tests pick bf16 or fp16 from this. fp16 training on the CPU works here
        whatever the answer (torch's float16 kernels, slow but exact): that is an extension, see
        docs/compatibility.md.
        """
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def amp(self):
        return torch.amp

    # ---- profiling and misc ----------------------------------------------------------------------

    def range_push(self, msg):
        pass

    def range_pop(self):
        pass

    def lazy_call(self, callback):
        callback()

    def capture_to_graph(self, graph, pool=None, stream=None):
        return contextlib.nullcontext()
