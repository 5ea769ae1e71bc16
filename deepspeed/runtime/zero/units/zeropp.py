# SPDX-License-Identifier: Apache-2.0
"""ZeRO++'s keys, checked once: what runs (hpZ, qwZ, qgZ) and what is refused, on every rank, before any collective.

* ``zero_hpz_partition_size`` (``h``): hpZ, a secondary copy of the 16-bit parameters sharded inside nodes of
  ``h`` ranks, so that ZeRO-3's backward all-gathers stay inside a node (``unit_fetch.py``). ``0`` and ``1``
  mean off; as upstream, ``h`` is capped at the data-parallel size and must then divide it.
* ``zero_quantized_weights``: qwZ, ZeRO-3's parameter all-gathers carry int8 blocks (``unit_fetch.py``).
* ``zero_quantized_gradients``: qgZ, ZeRO-3's gradient reduce-scatters run as 4-bit all-to-all hops
  (``quantized_reduce.py``); needs ``reduce_scatter`` (as upstream asserts).
* ``zero_quantized_nontrainable_weights``: frozen parameters (``requires_grad=False`` at ``initialize``) keep their
  ZeRO-3 shards as int8 blocks and float32 scales and are gathered so (``frozen_quant.py``); refused with
  ``offload_param`` (CPU or NVMe), whose host shards are 16-bit.
* ``zeropp_loco_param``: refused when the config is parsed, as upstream 0.19.8 refuses it (LoCo was removed).

All of them act on ZeRO stage 3 only; on stages 0-2 a ZeRO++ key that asks for something raises.
"""

from dataclasses import dataclass

from deepspeed.utils.node_axis import check_node_size

_PATH = "zero_optimization"


@dataclass(frozen=True)
class ZeroPP:
    """The ZeRO++ settings a stage acts on (all off by default)."""
    hpz_partition_size: int = 1  # the node size of hpZ (1: off), already capped at the data-parallel size
    quantized_weights: bool = False
    quantized_gradients: bool = False
    quantized_nontrainable_weights: bool = False

    @property
    def enabled(self):
        return (self.hpz_partition_size > 1 or self.quantized_weights or self.quantized_gradients
                or self.quantized_nontrainable_weights)


def check_zeropp(zero_config, stage, zero_world_size):
    """The :class:`ZeroPP` of a ``zero_optimization`` section; raises (NotImplementedError / ValueError) naming the
    keys for what cannot be honoured. Pure: call it on every rank before any collective."""
    h = int(zero_config.zero_hpz_partition_size)
    asked = []
    if h > 1:
        asked.append(f"{_PATH}.zero_hpz_partition_size={h}")
    if zero_config.zero_quantized_weights:
        asked.append(f"{_PATH}.zero_quantized_weights")
    if zero_config.zero_quantized_gradients:
        asked.append(f"{_PATH}.zero_quantized_gradients")
    if zero_config.zero_quantized_nontrainable_weights:
        asked.append(f"{_PATH}.zero_quantized_nontrainable_weights")
    if not asked:
        return ZeroPP()
    if stage != 3:
        raise NotImplementedError(f"ZeRO++ config keys {', '.join(repr(a) for a in asked)} act on ZeRO stage 3 only "
                                  f"(zero_optimization.stage is {stage}); set stage 3 or remove them - see "
                                  "docs/zero.md")
    if zero_config.zero_quantized_gradients and not zero_config.reduce_scatter:
        raise NotImplementedError(f"config key '{_PATH}.zero_quantized_gradients' needs '{_PATH}.reduce_scatter' "
                                  "true (the quantized reduction replaces the reduce-scatter), as upstream requires")
    offload_param = str(getattr(zero_config.offload_param_device, "value", zero_config.offload_param_device))
    if zero_config.zero_quantized_nontrainable_weights and offload_param not in ("none", "None"):
        raise NotImplementedError(f"config key '{_PATH}.zero_quantized_nontrainable_weights' (frozen weights stored "
                                  f"quantized) is not supported with '{_PATH}.offload_param' (device "
                                  f"{offload_param}): offloaded parameter shards are kept in the model dtype; remove "
                                  "one of them - see docs/zero.md")
    size = check_node_size(h, zero_world_size) if h > 1 else 1
    return ZeroPP(hpz_partition_size=size,
                  quantized_weights=bool(zero_config.zero_quantized_weights),
                  quantized_gradients=bool(zero_config.zero_quantized_gradients),
                  quantized_nontrainable_weights=bool(zero_config.zero_quantized_nontrainable_weights))
