# SPDX-License-Identifier: Apache-2.0
"""Activation checkpointing, as ``deepspeed.checkpointing``.

``checkpoint(function, *args)`` runs ``function`` without keeping its
intermediate activations and recomputes them during backward, on top of
``torch.utils.checkpoint`` (reentrant). ``non_reentrant_checkpoint`` does the
same with torch's non-reentrant implementation. Both reproduce the RNG streams
of the forward pass during recomputation: torch's CPU and device generators
(``preserve_rng_state``) and the model-parallel generators of
:class:`RNGStatesTracker`, so dropout masks match and the gradients equal those
of running ``function`` without checkpointing.

``configure`` accepts upstream's options. ``partition_activations``,
``contiguous_checkpointing`` (``contiguous_memory_optimization``),
``checkpoint_in_cpu`` (``cpu_checkpointing``), ``num_checkpoints``,
``synchronize`` and ``profile`` are recorded (see ``get_config``) and have no
effect on what is computed or stored: activations are recomputed, never
partitioned or moved to the host.
"""

import contextlib
import json

import torch
import torch.utils.checkpoint

from deepspeed.accelerator import get_accelerator

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


def checkpoint(function, *args):
    """``function(*args)`` with its activations recomputed in backward (reentrant checkpointing).

    Returns what ``function`` returns. Gradients flow to tensor arguments that
    require grad and to parameters ``function`` uses; they equal the gradients of
    calling ``function(*args)`` directly.
    """
    return torch.utils.checkpoint.checkpoint(_replaying_tracker(function), *args, use_reentrant=True)


def non_reentrant_checkpoint(function, *args):
    """Like :func:`checkpoint`, with torch's non-reentrant implementation (works with inputs that need no grad)."""
    return torch.utils.checkpoint.checkpoint(_replaying_tracker(function), *args, use_reentrant=False)


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
    """Record the model-parallel unit and the checkpointing options; mark checkpointing configured.

    Options come from ``deepspeed_config`` (its ``activation_checkpointing``
    section) and are overridden by the explicit arguments that are not None.
    The options are accepted for compatibility and have no effect (see the
    module docstring); ``mpu_`` gives ``model_parallel_cuda_manual_seed`` its
    tensor-parallel rank.
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
    _mpu = mpu_
    _options = options
    _configured = True


def is_configured():
    """True once :func:`configure` has been called (and :func:`reset` has not since)."""
    return _configured


def get_config():
    """The options recorded by :func:`configure` (defaults before it)."""
    return dict(_options)


def partition_activations_in_checkpoint(partition_activation):
    _options["partition_activations"] = bool(partition_activation)


def set_num_layers(nlayers):
    _options["num_checkpoints"] = nlayers


def reset():
    """Release buffers kept between forward passes (call between evaluation forwards).

    Activations are never kept in side buffers here, so there is nothing to
    release; the configuration and the RNG tracker are left as they are.
    """
