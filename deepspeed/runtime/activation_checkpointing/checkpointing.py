# SPDX-License-Identifier: Apache-2.0
"""Activation checkpointing, as ``deepspeed.checkpointing``.

``checkpoint(function, *args)`` runs ``function`` without keeping its
intermediate activations and recomputes them during backward (reentrant, torch's
``CheckpointFunction``). ``non_reentrant_checkpoint`` does the same with torch's
non-reentrant implementation. Both reproduce the RNG streams of the forward pass
during recomputation: torch's CPU and device generators (``preserve_rng_state``)
and the model-parallel generators of :class:`RNGStatesTracker`, so dropout masks
match and the gradients equal those of running ``function`` without checkpointing.

``configure`` takes upstream's options (from its arguments or the config's
``activation_checkpointing`` section; ``deepspeed.initialize`` applies a config's
section when ``configure`` was not called before). What each does:

* ``checkpoint_in_cpu`` (``cpu_checkpointing``), ``partition_activations``,
  ``contiguous_checkpointing`` (``contiguous_memory_optimization``) and
  ``num_checkpoints`` (``number_checkpoints``): where a checkpoint keeps its inputs
  until its backward (:mod:`.saved_inputs`: in host memory, copied asynchronously;
  one piece per model-parallel rank; in preallocated blocks). The values come back
  bit for bit, so gradients are those of plain checkpointing.
* ``synchronize`` (``synchronize_checkpoint_boundary``): the accelerator is
  synchronized at the start and end of each checkpoint's forward and backward (the
  non-reentrant backward: at the start of its recomputation).
* ``profile``: each checkpoint's forward and backward time is logged (rank 0 of
  ``SynchronizedWallClockTimer``'s log: ``fwd`` and ``bwd``).
"""

import contextlib
import json

import torch
import torch.utils.checkpoint
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import CheckpointFunction

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing.saved_inputs import InputStore

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"

# Offset between the data-parallel seed and the model-parallel seeds of model_parallel_cuda_manual_seed.
_MODEL_PARALLEL_SEED_OFFSET = 2718

_OPTION_KEYS = {
    # configure() argument -> activation_checkpointing config key
    "partition_activations": "partition_activations",
    "contiguous_checkpointing": "contiguous_memory_optimization",
    "num_checkpoints": "number_checkpoints",
    "checkpoint_in_cpu": "cpu_checkpointing",
    "synchronize": "synchronize_checkpoint_boundary",
    "profile": "profile",
}


def _default_options():
    return {
        "partition_activations": False,
        "contiguous_checkpointing": False,
        "num_checkpoints": None,
        "checkpoint_in_cpu": False,
        "synchronize": False,
        "profile": False,
    }


_configured = False
_mpu = None
_options = _default_options()
_store = InputStore()  # where checkpoints keep their inputs (configure() replaces it)
_configured_by_engine = False  # the options came from deepspeed.initialize, not from a configure() call
_timers = None


class RNGStatesTracker:
    """Named RNG states of the accelerator's generator, for regions that need their own random stream.

    ``add(name, seed)`` creates a state; inside ``with fork(name):`` the
    accelerator's generator runs from that state, and on exit the advanced state
    is stored back under ``name`` and the previous generator state is restored.
    """

    def __init__(self):
        self.states_ = {}
        self.seeds_ = set()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        """A copy of the {name: state} mapping (states are not mutated in place, so a shallow copy suffices)."""
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = dict(states)

    def add(self, name, seed):
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"RNG state {name} already exists")
        self.seeds_.add(seed)
        accelerator = get_accelerator()
        saved = accelerator.get_rng_state()
        accelerator.manual_seed(seed)
        self.states_[name] = accelerator.get_rng_state()
        accelerator.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name=_MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise RuntimeError(f"RNG state {name} is not added")
        accelerator = get_accelerator()
        saved = accelerator.get_rng_state()
        accelerator.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = accelerator.get_rng_state()
            accelerator.set_rng_state(saved)


CudaRNGStatesTracker = RNGStatesTracker

_RNG_STATE_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker():
    """The process-wide :class:`RNGStatesTracker`."""
    return _RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(seed):
    """Seed the accelerator generator with ``seed`` and the model-parallel stream with a per-TP-rank seed.

    The model-parallel seed is ``seed + 2718 + tensor_parallel_rank`` (rank from the
    configured ``mpu``, 0 without one), so tensor-parallel ranks draw different
    dropout masks inside ``get_cuda_rng_tracker().fork()`` and equal ones outside.
    """
    tp_rank = _mpu.get_model_parallel_rank() if _mpu is not None else 0
    get_accelerator().manual_seed(seed)
    _RNG_STATE_TRACKER.reset()
    _RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)


def _replaying_tracker(function):
    """Wrap ``function`` so that its recomputation sees the tracker states its first run saw.

    The first call records the tracker states; every later call (a
    recomputation in backward) runs from those states and restores the
    current ones afterwards, so recomputing does not advance the streams.
    """
    if not _RNG_STATE_TRACKER.states_:
        return function
    forward_states = _RNG_STATE_TRACKER.get_states()
    calls = [0]

    def run(*args):
        calls[0] += 1
        if calls[0] == 1:
            return function(*args)
        current = _RNG_STATE_TRACKER.get_states()
        _RNG_STATE_TRACKER.set_states(forward_states)
        try:
            return function(*args)
        finally:
            _RNG_STATE_TRACKER.set_states(current)

    return run


def _boundaries():
    """Whether checkpoints synchronize or time their boundaries."""
    return bool(_options["synchronize"] or _options["profile"])


def _timer(name):
    global _timers
    if _timers is None:
        from deepspeed.utils.timer import SynchronizedWallClockTimer
        _timers = SynchronizedWallClockTimer()
    return _timers(name)


def _boundary_start(name):
    if _options["synchronize"]:
        get_accelerator().synchronize()
    if _options["profile"]:
        _timer(name).start()


def _boundary_end(name):
    if _options["profile"]:
        _timer(name).stop()
        _timers.log([name])
    if _options["synchronize"]:
        get_accelerator().synchronize()


class _StoredCheckpoint(CheckpointFunction):
    """torch's reentrant checkpoint with its boundaries synchronized or timed as configured. Its inputs are kept by
    an :class:`InputStore` through saved-tensor hooks around ``apply`` (autograd packs what ``save_for_backward``
    named once ``forward`` returned; the layer runs without grad, so nothing else is saved there)."""

    @staticmethod
    def forward(ctx, run_function, preserve_rng_state, *args):
        _boundary_start("fwd")
        outputs = CheckpointFunction.forward(ctx, run_function, preserve_rng_state, *args)
        _boundary_end("fwd")
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        _boundary_start("bwd")
        result = CheckpointFunction.backward(ctx, *grads)
        _boundary_end("bwd")
        return result


def checkpoint(function, *args):
    """``function(*args)`` with its activations recomputed in backward (reentrant checkpointing).

    Returns what ``function`` returns. Gradients flow to tensor arguments that
    require grad and to parameters ``function`` uses; they equal the gradients of
    calling ``function(*args)`` directly. The inputs wait for the backward as
    ``configure`` says (module docstring).
    """
    function = _replaying_tracker(function)
    if not (_store.active or _boundaries()) or not torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)
    store = _store
    store.begin_checkpoint(sum(1 for a in args if torch.is_tensor(a)))
    with saved_tensors_hooks(store.pack, store.unpack):
        return _StoredCheckpoint.apply(function, True, *args)


def non_reentrant_checkpoint(function, *args):
    """Like :func:`checkpoint`, with torch's non-reentrant implementation (works with inputs that need no grad).

    With a store that keeps inputs elsewhere, torch's checkpoint is given a function that reads the inputs from
    the store (and one empty tensor per device for its RNG bookkeeping), so the inputs themselves are not held.
    """
    function = _replaying_tracker(function)
    store = _store
    if not (store.active or _boundaries()) or not torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    if not store.active:
        return _timed_non_reentrant(function, args)
    store.begin_checkpoint(sum(1 for a in args if torch.is_tensor(a)))
    held = [store.pack(a) if torch.is_tensor(a) else a for a in args]
    flags = [a.requires_grad if torch.is_tensor(a) else None for a in args]
    first = [list(args)]  # the forward reads the inputs themselves (its graph links to them), once
    del args
    anchors = []
    for item in held:
        tensor = getattr(item, "tensor", None) if not torch.is_tensor(item) else item
        device = getattr(item, "device", None) if tensor is None else tensor.device
        if device is not None and device.type != "cpu" and all(a.device != device for a in anchors):
            anchors.append(torch.empty(0, device=device))

    def run(*_anchors):
        if first:
            inputs = first.pop()
            if _options["synchronize"]:
                get_accelerator().synchronize()
            return function(*inputs)
        _boundary_start("bwd")
        inputs = []
        for item, flag in zip(held, flags):
            if flag is None:
                inputs.append(item)
            else:
                inputs.append(store.unpack(item).detach().requires_grad_(flag))
        return function(*inputs)

    _boundary_start("fwd")
    outputs = torch.utils.checkpoint.checkpoint(run, *anchors, use_reentrant=False)
    _boundary_end("fwd")
    return outputs


def _timed_non_reentrant(function, args):
    calls = [0]

    def run(*inputs):
        calls[0] += 1
        if calls[0] > 1:
            _boundary_start("bwd")
        return function(*inputs)

    _boundary_start("fwd")
    outputs = torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)
    _boundary_end("fwd")
    return outputs


def _section_from_config(deepspeed_config):
    """The ``activation_checkpointing`` section of a DeepSpeedConfig, a config dict or a JSON path."""
    if deepspeed_config is None:
        return {}
    if isinstance(deepspeed_config, str):
        with open(deepspeed_config) as config_file:
            deepspeed_config = json.load(config_file)
    if isinstance(deepspeed_config, dict):
        return dict(deepspeed_config.get("activation_checkpointing") or {})
    section = getattr(deepspeed_config, "activation_checkpointing_config", None)
    if section is None:
        return {}
    if isinstance(section, dict):
        return dict(section)
    return {key: getattr(section, key) for key in _OPTION_KEYS.values() if hasattr(section, key)}


def configure(mpu_=None,
              deepspeed_config=None,
              partition_activations=None,
              contiguous_checkpointing=None,
              num_checkpoints=None,
              checkpoint_in_cpu=None,
              synchronize=None,
              profile=None):
    """Set the model-parallel unit and the checkpointing options; mark checkpointing configured.

    Options come from ``deepspeed_config`` (its ``activation_checkpointing``
    section) and are overridden by the explicit arguments that are not None
    (module docstring). ``mpu_`` (kept from an earlier call when None) gives
    ``partition_activations`` its group (``get_tensor_model_parallel_group``, else
    ``get_model_parallel_group``) and ``model_parallel_cuda_manual_seed`` its rank.
    Raises ValueError for ``contiguous_checkpointing`` without
    ``partition_activations`` or without ``num_checkpoints``, as upstream does.
    """
    global _configured, _mpu, _options
    section = _section_from_config(deepspeed_config)
    options = _default_options()
    for option, key in _OPTION_KEYS.items():
        if key in section and section[key] is not None:
            options[option] = section[key]
    explicit = dict(partition_activations=partition_activations,
                    contiguous_checkpointing=contiguous_checkpointing,
                    num_checkpoints=num_checkpoints,
                    checkpoint_in_cpu=checkpoint_in_cpu,
                    synchronize=synchronize,
                    profile=profile)
    options.update({option: value for option, value in explicit.items() if value is not None})
    if options["contiguous_checkpointing"] and not options["partition_activations"]:
        raise ValueError("contiguous_checkpointing requires partition_activations")
    if options["contiguous_checkpointing"] and options["num_checkpoints"] is None:
        raise ValueError("contiguous_checkpointing requires num_checkpoints (number_checkpoints)")
    if mpu_ is not None:
        _mpu = mpu_
    _options = options
    _rebuild_store()
    _configured = True
    _set_by_engine(False)


def _set_by_engine(value):
    global _configured_by_engine
    _configured_by_engine = value


def _partition_group():
    """The model-parallel group inputs are partitioned over (None: no mpu, or partitioning is off)."""
    if not _options["partition_activations"] or _mpu is None:
        return None
    if hasattr(_mpu, "get_tensor_model_parallel_group"):
        return _mpu.get_tensor_model_parallel_group()
    return _mpu.get_model_parallel_group()


def _rebuild_store():
    global _store
    _store.reset()
    _store = InputStore(cpu=_options["checkpoint_in_cpu"],
                        group=_partition_group(),
                        contiguous=_options["contiguous_checkpointing"],
                        num_checkpoints=_options["num_checkpoints"])


def get_input_store():
    """The :class:`~.saved_inputs.InputStore` checkpoints keep their inputs in now (its ``stats`` count)."""
    return _store


def configure_from_engine(ds_config, mpu_=None):
    """``deepspeed.initialize``: apply the config's ``activation_checkpointing`` section when the user gave one and
    did not call :func:`configure` before (an explicit call wins, as it does when it comes after; a later engine's
    section replaces an earlier engine's). The
    model-parallel unit is ``mpu_``, else the engine's mesh (``deepspeed.utils.groups``) when it has a
    tensor-parallel axis."""
    param_dict = getattr(ds_config, "_param_dict", None) or {}
    if (_configured and not _configured_by_engine) or "activation_checkpointing" not in param_dict:
        return
    if mpu_ is None:
        from deepspeed.utils import groups
        try:
            if groups.get_tensor_model_parallel_world_size() > 1:
                mpu_ = groups
        except (AssertionError, RuntimeError):  # no mesh with a tensor axis
            mpu_ = None
    configure(mpu_, deepspeed_config=ds_config)
    _set_by_engine(True)


def is_configured():
    """True once :func:`configure` has been called (and :func:`reset` has not since)."""
    return _configured


def get_config():
    """The options recorded by :func:`configure` (defaults before it)."""
    return dict(_options)


def partition_activations_in_checkpoint(partition_activation):
    _options["partition_activations"] = bool(partition_activation)
    _rebuild_store()


def set_num_layers(nlayers):
    _options["num_checkpoints"] = nlayers
    _rebuild_store()


def reset():
    """Release what is kept between forward passes (call between evaluation forwards): the contiguous blocks and
    the offload order start afresh; copies in flight complete. The configuration and the RNG tracker stay."""
    _store.reset()
