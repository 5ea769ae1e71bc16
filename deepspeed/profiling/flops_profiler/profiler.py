# SPDX-License-Identifier: Apache-2.0
"""The flops profiler: per-module flops, parameters and forward latency, on ``torch.utils.flop_counter``.

While a profile runs (between :meth:`FlopsProfiler.start_profile` and :meth:`FlopsProfiler.stop_profile`), a
``TorchDispatchMode`` sees every aten operator the forward runs and prices it with torch's own flop formulas
(``torch.utils.flop_counter.flop_registry``: matrix products, convolutions, attention). Forward hooks on every
module keep the stack of modules running, so an operator's flops count towards each module it runs in (a module
called twice counts both calls), and time each module's forward (synchronising the device around it, which is why
only a profiled step pays for it). Elementwise operators, normalisations and softmax cost no flops in torch's
formulas; MACs are half the flops.

Backward is not traced: the backward of a forward costs twice its flops (the product with the weight and with the
input), plus ``recompute_fwd_factor`` times the forward where activation checkpointing recomputes it. The engine
reports, for its ``profile_step``: the profiled forwards' flops and latency, the measured backward and step
latencies, and the achieved FLOP/s of the step, ``(3 + recompute_fwd_factor) x fwd flops / iteration latency``.
"""

import dataclasses
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .report import flops_to_string, macs_to_string, params_to_string, render


@dataclasses.dataclass
class ModuleRecord:
    """What one module cost over the profiled forwards (``name`` is its qualified name, ``""`` for the root)."""
    name: str
    module_type: str
    depth: int
    params: int
    flops: int = 0
    latency_s: float = 0.0
    calls: int = 0

    @property
    def macs(self):
        return self.flops // 2


class _FlopCountingMode(TorchDispatchMode):
    """Prices each operator with torch's flop formulas and charges the profiler's running modules."""

    def __init__(self, profiler):
        super().__init__()
        self._profiler = profiler

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self._profiler._charge(int(formula(*args, **kwargs, out_val=out)))
        return out


def _numel(param):
    # A ZeRO-3 parameter holds a shard; its full size is ds_numel.
    return int(getattr(param, "ds_numel", param.numel()))


class FlopsProfiler:
    """Profiles the forward passes of ``model`` between ``start_profile()`` and ``stop_profile()``.

    Results accumulate over every profiled forward until ``reset_profile()`` or ``end_profile()`` (which also
    removes the hooks). ``ds_engine``, when given, supplies the batch size and world size of the report and the
    engine's measured backward/step latencies (``step_latencies``).
    """

    def __init__(self, model, ds_engine=None, recompute_fwd_factor=0.0):
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.started = False
        self.step_latencies = None  # {"bwd": s, "step": s, "iter": s}: set by the engine for its report
        self.last_profile = None  # the summary of the last print_model_profile(), kept after end_profile()
        self._handles = []
        self._records = {}
        self._stack = []
        self._total_flops = 0
        self._mode = None

    # ------------------------------------------------------------- profiling
    def start_profile(self, ignore_list=None):
        """Start (or resume) counting; ``ignore_list``: module types that get no hooks (their cost goes to the
        enclosing module)."""
        if not self._handles:
            self._install(tuple(ignore_list or ()))
        self.started = True
        if self._mode is None:
            self._mode = _FlopCountingMode(self)
            self._mode.__enter__()

    def stop_profile(self):
        """Stop counting; the results so far are kept."""
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        self._stack = []

    def reset_profile(self):
        for record in self._records.values():
            record.flops, record.latency_s, record.calls = 0, 0.0, 0
        self._total_flops = 0

    def end_profile(self):
        """Stop, remove every hook and drop the results (``last_profile`` stays)."""
        self.stop_profile()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._records = {}
        self._total_flops = 0
        self.started = False

    def _install(self, ignore_types):
        first = next(self.model.parameters(), None)
        on_device = first is not None and first.device.type != "cpu"
        if on_device:
            from deepspeed.accelerator import get_accelerator
            self._sync = get_accelerator().synchronize
        else:
            self._sync = _no_sync
        for name, module in self.model.named_modules():
            if ignore_types and isinstance(module, ignore_types) and name:
                continue
            record = ModuleRecord(name=name,
                                  module_type=type(module).__name__,
                                  depth=0 if not name else name.count(".") + 1,
                                  params=sum(_numel(p) for p in module.parameters()))
            self._records[name] = record
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(record)))
            self._handles.append(module.register_forward_hook(self._post_hook(record), always_call=True))

    def _pre_hook(self, record):

        def enter(module, args):
            if self._mode is None:  # not profiling now (e.g. a recompute inside backward)
                return
            self._sync()
            self._stack.append((record, time.perf_counter()))

        return enter

    def _post_hook(self, record):

        def leave(module, args, output):
            if self._mode is None or not self._stack or self._stack[-1][0] is not record:
                return
            self._sync()
            _, start = self._stack.pop()
            record.latency_s += time.perf_counter() - start
            record.calls += 1

        return leave

    def _charge(self, flops):
        self._total_flops += flops
        for record in {id(r): r for r, _ in self._stack}.values():
            record.flops += flops

    # ------------------------------------------------------------- results
    def module_profiles(self):
        """``{qualified name: ModuleRecord}`` (copies) of the profiled forwards."""
        return {name: dataclasses.replace(record) for name, record in self._records.items()}

    def get_total_flops(self, as_string=False):
        return flops_to_string(self._total_flops) if as_string else self._total_flops

    def get_total_macs(self, as_string=False):
        return macs_to_string(self._total_flops // 2) if as_string else self._total_flops // 2

    def get_total_duration(self, as_string=False):
        root = self._records.get("")
        seconds = root.latency_s if root else 0.0
        from .report import duration_to_string
        return duration_to_string(seconds) if as_string else seconds

    def get_total_params(self, as_string=False):
        root = self._records.get("")
        params = root.params if root else sum(_numel(p) for p in self.model.parameters())
        return params_to_string(params) if as_string else params

    def profile_summary(self, profile_step=None):
        """The numbers of the report's summary, as a dict (see ``report.summary_lines`` for their meaning)."""
        root = self._records.get("")
        fwd_flops = self._total_flops
        summary = dict(step=profile_step,
                       params=self.get_total_params(),
                       fwd_flops=fwd_flops,
                       fwd_macs=fwd_flops // 2,
                       fwd_latency_s=root.latency_s if root else 0.0,
                       forward_calls=root.calls if root else 0,
                       recompute_fwd_factor=self.recompute_fwd_factor,
                       modules=self.module_profiles())
        engine = self.ds_engine
        if engine is not None:
            summary.update(world_size=getattr(engine, "world_size", None),
                           dp_world_size=getattr(engine, "dp_world_size", None),
                           micro_batch_size=engine.train_micro_batch_size_per_gpu())
        latencies = self.step_latencies
        if latencies is not None:
            bwd_flops = int((2.0 + self.recompute_fwd_factor) * fwd_flops)
            iter_latency = latencies["iter"]
            summary.update(bwd_flops=bwd_flops,
                           bwd_latency_s=latencies["bwd"],
                           step_latency_s=latencies["step"],
                           iter_latency_s=iter_latency,
                           flops_per_s=(fwd_flops + bwd_flops) / iter_latency if iter_latency > 0 else 0.0)
            if summary.get("micro_batch_size") and iter_latency > 0:
                summary["samples_per_s"] = summary["micro_batch_size"] * summary["forward_calls"] / iter_latency
        return summary

    def print_model_profile(self, profile_step=1, module_depth=-1, top_modules=1, detailed=True, output_file=None):
        """Print the profile (or write it to ``output_file``); returns the summary dict, also kept as
        ``last_profile``."""
        summary = self.profile_summary(profile_step)
        text = render(summary, self._records, self.model, module_depth, top_modules, detailed)
        if output_file:
            with open(output_file, "w") as handle:
                handle.write(text + "\n")
        else:
            print(text, flush=True)
        self.last_profile = summary
        return summary

    def print_model_aggregated_profile(self, module_depth=-1, top_modules=1):
        from .report import aggregated_lines
        print("\n".join(aggregated_lines(self._records, module_depth, top_modules)), flush=True)


def _no_sync():
    pass


def _model_input(model, input_shape):
    first = next(model.parameters(), None)
    dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
    device = first.device if first is not None else torch.device("cpu")
    return torch.zeros(*input_shape, dtype=dtype, device=device)


def get_model_profile(model,
                      input_shape=None,
                      args=None,
                      kwargs=None,
                      print_profile=True,
                      detailed=True,
                      module_depth=-1,
                      top_modules=1,
                      warm_up=1,
                      as_string=True,
                      output_file=None,
                      ignore_modules=None,
                      mode="forward"):
    """Profile one forward of ``model`` and return ``(flops, macs, params)`` (strings with ``as_string``).

    The input is ``args``/``kwargs``, or, with ``input_shape``, one tensor of that shape (zeros, in the dtype and
    on the device of the model's first parameter). ``warm_up`` unprofiled forwards run first. ``mode="generate"``
    profiles ``model.generate(...)`` instead of ``model(...)``. Runs under ``torch.no_grad()``.
    """
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")
    args = list(args or [])
    kwargs = dict(kwargs or {})
    if input_shape is not None:
        if args or kwargs:
            raise ValueError("get_model_profile: give input_shape or args/kwargs, not both")
        args = [_model_input(model, tuple(input_shape))]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, or the model's args/kwargs")
    run = model.generate if mode == "generate" else model
    profiler = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(warm_up):
            run(*args, **kwargs)
        profiler.start_profile(ignore_list=ignore_modules)
        try:
            run(*args, **kwargs)
        finally:
            profiler.stop_profile()
    flops, macs, params = profiler.get_total_flops(), profiler.get_total_macs(), profiler.get_total_params()
    if print_profile:
        profiler.print_model_profile(profile_step=warm_up,
                                     module_depth=module_depth,
                                     top_modules=top_modules,
                                     detailed=detailed,
                                     output_file=output_file)
    profiler.end_profile()
    if as_string:
        return flops_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
