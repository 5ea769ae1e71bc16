# SPDX-License-Identifier: Apache-2.0
"""The accelerator interface: one object that answers every device question.

Runtime code never names a device backend directly; it asks ``get_accelerator()``
for device names, streams, events, memory statistics, RNG state and the
communication backend, so that the same code runs on CUDA GPUs and on plain CPU
processes (where streams and events are no-ops and the backend is gloo).

Method names and signatures follow upstream DeepSpeed's accelerator, which
frameworks (HF Accelerate, Transformers, Lightning) call directly.
"""

import abc


class DeepSpeedAccelerator(abc.ABC):
    """Abstract device backend.

    Subclasses set ``_name`` (the device type, e.g. ``"cuda"``),
    ``_communication_backend_name`` (the torch.distributed backend) and
    ``_compile_backend`` (the ``torch.compile`` backend), and implement the
    abstract methods below. The synchronisation predicates default to the answer
    for an asynchronous device.
    """

    def __init__(self):
        self._name = None
        self._communication_backend_name = None
        self._compile_backend = None

    # ---- execution model -------------------------------------------------------------------------

    @abc.abstractmethod
    def is_synchronized_device(self):
        """True when kernels complete before the launching call returns (no streams to wait on)."""
        ...

    def use_host_timers(self):
        """True when wall-clock host timers measure device work (no device events needed)."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self):
        """True when the device orders dependent work itself, so no stream waits are needed."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self):
        """True when the host cannot run ahead of the device and exhaust its memory."""
        return self.is_synchronized_device()

    # ---- devices ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def device_name(self, device_index=None):
        """The device string: ``"cuda"`` / ``"cuda:N"``; always ``"cpu"`` on CPU."""
        ...

    @abc.abstractmethod
    def device(self, device_index=None):
        """A context manager that makes ``device_index`` current while it is entered."""
        ...

    @abc.abstractmethod
    def set_device(self, device_index):
        ...

    @abc.abstractmethod
    def current_device(self):
        """The index of the current device (an int)."""
        ...

    @abc.abstractmethod
    def current_device_name(self):
        """``device_name(current_device())``, usable as ``torch.device(...)``."""
        ...

    @abc.abstractmethod
    def device_count(self):
        ...

    @abc.abstractmethod
    def synchronize(self, device_index=None):
        """Block the host until all queued work on the device has completed."""
        ...

    @abc.abstractmethod
    def is_available(self):
        ...

    def on_accelerator(self, tensor):
        """True when ``tensor`` lives on this accelerator's device type."""
        return tensor.device.type == self._name

    # ---- RNG -------------------------------------------------------------------------------------

    @abc.abstractmethod
    def random(self):
        """The module that owns the RNG functions (``torch.random``)."""
        ...

    @abc.abstractmethod
    def set_rng_state(self, new_state, device_index=None):
        ...

    @abc.abstractmethod
    def get_rng_state(self, device_index=None):
        ...

    @abc.abstractmethod
    def manual_seed(self, seed):
        ...

    @abc.abstractmethod
    def manual_seed_all(self, seed):
        ...

    @abc.abstractmethod
    def initial_seed(self):
        ...

    @abc.abstractmethod
    def default_generator(self, device_index):
        ...

    # ---- streams and events ----------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def Stream(self):
        """The stream class; ``Stream()`` makes a new stream."""
        ...

    @abc.abstractmethod
    def stream(self, stream):
        """A context manager that makes ``stream`` current while it is entered."""
        ...

    @abc.abstractmethod
    def current_stream(self, device_index=None):
        ...

    @abc.abstractmethod
    def default_stream(self, device_index=None):
        ...

    @property
    @abc.abstractmethod
    def Event(self):
        """The event class; ``Event(enable_timing=True)`` can time work between two records."""
        ...

    # ---- memory ----------------------------------------------------------------------------------

    @abc.abstractmethod
    def empty_cache(self):
        ...

    @abc.abstractmethod
    def memory_allocated(self, device_index=None):
        """Bytes currently held by tensors."""
        ...

    @abc.abstractmethod
    def max_memory_allocated(self, device_index=None):
        """Peak of ``memory_allocated`` since the last ``reset_peak_memory_stats``."""
        ...

    def reset_max_memory_allocated(self, device_index=None):
        self.reset_peak_memory_stats(device_index)

    @abc.abstractmethod
    def memory_reserved(self, device_index=None):
        """Bytes held by the allocator (allocated plus cached)."""
        ...

    @abc.abstractmethod
    def max_memory_reserved(self, device_index=None):
        ...

    def memory_cached(self, device_index=None):
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index=None):
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index=None):
        self.reset_peak_memory_stats(device_index)

    @abc.abstractmethod
    def memory_stats(self, device_index=None):
        """A dict of allocator statistics (keys as ``torch.cuda.memory_stats`` where they exist)."""
        ...

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index=None):
        ...

    @abc.abstractmethod
    def total_memory(self, device_index=None):
        """Bytes of device memory in total."""
        ...

    @abc.abstractmethod
    def available_memory(self, device_index=None):
        """Bytes of device memory that can still be allocated."""
        ...

    @abc.abstractmethod
    def pin_memory(self, tensor, align_bytes=1, make_copy=True, match_shape=True):
        """A page-locked copy of a host tensor where the platform has pinned memory, else ``tensor`` (flat when
        ``match_shape`` is false; ``make_copy=False`` allows an uninitialised allocation).
        ``DS_PIN_MEMORY_BACKEND=native`` pins through ``deepspeed.utils.pin_memory``."""
        ...

    @abc.abstractmethod
    def is_pinned(self, tensor):
        ...

    def unpin_memory(self, tensor):
        """Release a tensor's pinning early. Memory pinned through torch is released with the tensor, so this does
        nothing and returns None (upstream's answer for its torch backend; its native allocator answers True)."""
        return None

    # ---- data types ------------------------------------------------------------------------------

    @abc.abstractmethod
    def is_bf16_supported(self):
        ...

    @abc.abstractmethod
    def is_fp16_supported(self):
        ...

    def supported_dtypes(self):
        """The floating-point dtypes training can use on this device."""
        import torch
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    @abc.abstractmethod
    def amp(self):
        """The autocast module (``torch.amp``), or None where autocast is unavailable."""
        ...

    # ---- profiling and misc ----------------------------------------------------------------------

    @abc.abstractmethod
    def range_push(self, msg):
        """Open a named profiler range (nvtx on CUDA); a no-op where there is no such tool."""
        ...

    @abc.abstractmethod
    def range_pop(self):
        ...

    @abc.abstractmethod
    def lazy_call(self, callback):
        """Run ``callback`` once the device runtime is initialised (now, if it already is)."""
        ...

    def communication_backend_name(self):
        """The torch.distributed backend for this device (``"nccl"`` / ``"gloo"``)."""
        return self._communication_backend_name

    def is_triton_supported(self):
        return False

    def create_graph(self):
        """A device graph object, or None where graphs are not supported."""
        return None

    @abc.abstractmethod
    def capture_to_graph(self, graph, pool=None, stream=None):
        ...

    def replay_graph(self, graph):
        if graph is not None:
            graph.replay()

    # ---- extensions and environment --------------------------------------------------------------

    def op_builder_dir(self):
        return "deepspeed.ops.op_builder"

    def create_op_builder(self, class_name):
        """An instance of the op builder called ``class_name`` (``deepspeed.ops.op_builder``), or None."""
        builder = self.get_op_builder(class_name)
        return builder() if builder is not None else None

    def get_op_builder(self, class_name):
        """The op builder class called ``class_name`` (e.g. ``"CPUAdamBuilder"``), or None."""
        from deepspeed.ops.op_builder import builder_class
        return builder_class(class_name)

    def build_extension(self):
        from torch.utils.cpp_extension import BuildExtension
        return BuildExtension

    def export_envs(self):
        """Prefixes of environment variables a multi-node launcher forwards to every node."""
        return []

    def visible_devices_envs(self):
        """The environment variables that restrict which devices a process sees."""
        return []

    def set_visible_devices_envs(self, current_env, local_accelerator_ids):
        """Write ``local_accelerator_ids`` into every variable of ``visible_devices_envs()`` in ``current_env``."""
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self):
        return self._compile_backend

    def set_compile_backend(self, backend):
        self._compile_backend = backend
