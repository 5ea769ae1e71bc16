# SPDX-License-Identifier: Apache-2.0
"""The training monitor: events ``(name, value, step)`` fanned out to TensorBoard, CSV files, W&B and Comet.

An *event* is a tuple ``(name, value, step)``: ``name`` a ``/``-separated tag such as
``Train/Samples/train_loss``, ``value`` a number (a 0-d tensor is converted), ``step`` the engine's
``global_samples`` at the time of writing. :class:`MonitorMaster` holds one :class:`Monitor` per enabled backend
and writes every event to each of them.

Only global rank 0 writes. The other ranks build no backend and touch no file; their ``write_events`` returns at
once. Building a backend can fail (an output path that cannot be written, an optional package that is not
installed); rank 0 finds out, and the ranks agree on its verdict with one small broadcast at construction, so every
rank raises the same error before training starts instead of rank 0 failing alone.
"""

import abc
import math
import numbers

import torch

from deepspeed.runtime.config_utils import DeepSpeedConfigError

# What building a backend raises for a bad setup; anything else is a bug and propagates as it is.
SETUP_ERRORS = (DeepSpeedConfigError, ImportError, OSError)


class Monitor(abc.ABC):
    """One monitoring backend. ``write_events`` takes a list of ``(name, value, step)`` tuples."""

    def __init__(self, monitor_config):
        self.monitor_config = monitor_config
        self.enabled = bool(getattr(monitor_config, "enabled", True))

    @abc.abstractmethod
    def write_events(self, event_list):
        """Record every event of ``event_list``, in order."""

    def update_config(self, config_dict):
        """Record the run's configuration (a dict) where the backend has a place for it."""

    def flush(self):
        """Push buffered events to their destination."""

    def close(self):
        """Flush and release files or connections; later ``write_events`` calls do nothing."""


def event_value(value):
    """A plain float for an event value: 0-d (or one-element) tensors and numpy scalars are converted."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"a monitor event value must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().float().cpu().item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"a monitor event value must be a number, got {type(value).__name__}")
    return float(value)


def check_events(event_list):
    """``event_list`` as a list of ``(str, float, int)``; raises a clear error for a malformed event."""
    events = []
    for event in event_list:
        if not isinstance(event, (tuple, list)) or len(event) != 3:
            raise ValueError(f"a monitor event must be a (name, value, step) tuple, got {event!r}")
        name, value, step = event
        if not isinstance(name, str) or not name:
            raise ValueError(f"a monitor event name must be a non-empty string, got {name!r}")
        if isinstance(step, float) and math.isfinite(step) and step.is_integer():
            step = int(step)
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise ValueError(f"the step of monitor event {name!r} must be an integer, got {step!r}")
        events.append((name, event_value(value), int(step)))
    return events


def _global_rank():
    import deepspeed.comm as dist
    return dist.get_rank() if dist.is_initialized() else 0


def _agree_on_setup_error(error):
    """Collective: rank 0's setup error (or None) is raised on every rank."""
    import deepspeed.comm as dist
    payload = None if error is None else (type(error), str(error))
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [payload]
        dist.broadcast_object_list(box, src=0)
        payload = box[0]
    if payload is None:
        return
    error_type, message = payload
    if error is not None:
        raise error
    if not (isinstance(error_type, type) and issubclass(error_type, SETUP_ERRORS)):
        error_type = RuntimeError
    raise error_type(f"{message} (detected on rank 0)")


class MonitorMaster(Monitor):
    """Every enabled backend of a :class:`~deepspeed.monitor.config.DeepSpeedMonitorConfig`, on global rank 0.

    Construction is collective when any backend is enabled and torch.distributed is initialised: call it on every
    rank, in the same order, with the same sections enabled (the engine's config is the same on every rank).
    Afterwards either every rank raised the same setup error, or rank 0 holds one open backend per enabled section
    and the other ranks hold none.
    """

    def __init__(self, monitor_config):
        super().__init__(monitor_config)
        self.enabled = monitor_config.enabled
        self.tb_monitor = None
        self.csv_monitor = None
        self.wandb_monitor = None
        self.comet_monitor = None
        if not self.enabled:
            return
        error = None
        if _global_rank() == 0:
            try:
                self._build(monitor_config)
            except SETUP_ERRORS as err:
                self.close()
                error = err
        _agree_on_setup_error(error)

    def _build(self, cfg):
        from .comet import CometMonitor
        from .csv_monitor import CSVMonitor
        from .tensorboard import TensorBoardMonitor
        from .wandb import WandbMonitor
        if cfg.tensorboard.enabled:
            self.tb_monitor = TensorBoardMonitor(cfg.tensorboard)
        if cfg.csv_monitor.enabled:
            self.csv_monitor = CSVMonitor(cfg.csv_monitor)
        if cfg.wandb.enabled:
            self.wandb_monitor = WandbMonitor(cfg.wandb)
        if cfg.comet.enabled:
            self.comet_monitor = CometMonitor(cfg.comet)

    @property
    def monitors(self):
        """The backends this rank writes to (empty on every rank but 0)."""
        return [
            m for m in (self.tb_monitor, self.csv_monitor, self.wandb_monitor, self.comet_monitor) if m is not None
        ]

    def write_events(self, event_list):
        backends = self.monitors
        if not backends:
            return
        events = check_events(event_list)
        for backend in backends:
            backend.write_events(events)

    def update_config(self, config_dict):
        for backend in self.monitors:
            backend.update_config(config_dict)

    def flush(self):
        for backend in self.monitors:
            backend.flush()

    def close(self):
        for backend in self.monitors:
            backend.close()
        self.tb_monitor = self.csv_monitor = self.wandb_monitor = self.comet_monitor = None
