# SPDX-License-Identifier: Apache-2.0
"""``engine.offload_states()`` / ``reload_states()``: the engine's state off the device between phases.

RL trainers that put generation (vLLM) and training on the same GPUs empty the GPU between the phases
(OpenRLHF's ``--deepspeed_enable_sleep``, ROLL's strategy after every optimizer step). The state is the
engine's *state table*: the module's parameters plus what the ZeRO stage lists
(:meth:`~deepspeed.runtime.zero.stage_base.ZeroStage.state_table`), by :class:`OffloadStateTypeEnum`
kind; :class:`~deepspeed.runtime.zero.offload.state_placement.StatePlacement` moves it. Works on ZeRO 0-3, with
or without an optimizer (reference and reward models), with parameter offload and with the host step
(state already on the host is not moved again, as upstream leaves it).

Defined behaviour (docs/offload.md):

* ``include=None`` is every kind; kinds whose state is on the host already are skipped.
* Offloading again moves only what is still on the device; reloading with nothing offloaded does nothing.
* A subset moves the storages of those kinds; a storage two kinds share moves with either (ZeRO-0 fp32
  parameters are their own masters). On ZeRO-3 without offload the gathers read the fp32 masters: moving
  the masters alone (OpenRLHF's set) gives the parameters 16-bit shards of their own first, so forwards
  and ``GatheredParameters`` keep working.
* ``forward``, ``backward``, ``step``, ``zero_grad`` and checkpoints raise :class:`EngineUsageError` on
  every rank when a kind they need is offloaded (no transparent reload: memory the caller freed for
  another process stays free until ``reload_states()``).
"""

import logging

import torch

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.engine_parts.usage_errors import EngineUsageError
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum as Kind
from deepspeed.runtime.zero.offload.state_placement import StatePlacement
from deepspeed.utils.logging import logger

# What each engine operation reads or writes of the state table.
NEEDS = {
    "forward": (Kind.lp_params, ),
    "backward": (Kind.lp_params, Kind.lp_grads, Kind.contiguous_grad_buffer),
    "zero_grad": (Kind.lp_grads, Kind.contiguous_grad_buffer),
    "step": tuple(Kind),
    "save_checkpoint": tuple(Kind),
    "load_checkpoint": tuple(Kind),
}


def _kind(value):
    try:
        return Kind(getattr(value, "value", value))
    except ValueError:
        raise ValueError(f"offload_states(include=...): unknown state {value!r}; the states are "
                         f"{[k.value for k in Kind]}") from None


class EngineStates:
    """The state table of one engine and its placement (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.placement = StatePlacement(engine.device)
        self.last_moved_bytes = 0

    def table(self):
        engine = self.engine
        stage = engine._stage
        table = stage.state_table() if stage is not None else {kind: [] for kind in Kind}
        # the module's parameters (ZeRO-3: released, zero bytes; with parameter offload: on the host)
        table[Kind.lp_params] = list(table[Kind.lp_params]) + [p for p in engine.module.parameters()]
        return table

    def require(self, operation):
        """Raise unless every kind ``operation`` needs is on the device (cheap when nothing is offloaded)."""
        if not self.placement.offloaded:
            return
        missing = sorted(k.value for k in set(NEEDS[operation]) & self.placement.offloaded_kinds())
        if missing:
            raise EngineUsageError(f"engine.{operation}() needs the engine states {missing}, which "
                                   f"engine.offload_states() moved off the device; call engine.reload_states() "
                                   f"first (docs/offload.md)")

    def offload(self, include=None, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False):
        device = OffloadDeviceEnum(getattr(device, "value", device))
        if device == OffloadDeviceEnum.none:
            logger.warning("offload_states(device='none'): no device to offload to; nothing is moved")
            return
        if device == OffloadDeviceEnum.nvme:
            raise ValueError("offload_states(device='nvme') is not supported: states go to host memory ('cpu')")
        stage = self.engine._stage
        if stage is not None:
            why = stage.offload_unsupported()
            if why is not None:
                raise NotImplementedError(f"engine.offload_states() is not supported with {why}; see "
                                          f"docs/compatibility.md")
        kinds = list(Kind) if include is None else [_kind(k) for k in include]
        if stage is not None:
            stage.before_offload(set(kinds))
        self.last_moved_bytes = self.placement.offload(self.table(), kinds, pin_memory, non_blocking)
        if stage is not None:
            stage.after_offload(self.placement.offloaded_kinds())
        get_accelerator().empty_cache()
        logger.log(logging.DEBUG, f"offload_states: {self.last_moved_bytes} bytes to the host")

    def reload(self, non_blocking=False):
        if not self.placement.offloaded:
            return
        self.last_moved_bytes = self.placement.reload(non_blocking)
        if self.engine._stage is not None:
            self.engine._stage.after_reload()

    def devices(self, kind):
        """Where the tensors of ``kind`` live: the device, the host (offloaded, or a host tier), or both."""
        kind = _kind(kind)
        out = self.placement.devices(self.table(), kind)
        stage = self.engine._stage
        if stage is not None and kind in stage.host_kinds():
            out.add(torch.device("cpu"))
        return out

    def device_bytes(self):
        """Bytes of the table's storages still on the device."""
        return sum(e.nbytes for e in self.placement.entries(self.table()).values())
