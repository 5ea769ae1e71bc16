# SPDX-License-Identifier: Apache-2.0
"""Building a ZeRO stage: one typed configuration and a registry of stage classes.

The engine turns its :class:`~deepspeed.runtime.config.DeepSpeedConfig` into a frozen
:class:`StageConfig` and calls :func:`build_stage`; it never branches on the stage number
nor reads a stage's fields. A stage class takes ``(module, optimizer, config, clock,
device=, group=)`` and provides the interface of
:class:`~deepspeed.runtime.zero.stage_base.ZeroStage`.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from deepspeed.runtime.precision.low_precision_masters import master_dtype
from deepspeed.runtime.zenflow.config import check_zenflow_stage
from deepspeed.runtime.zero.units.zeropp import ZeroPP, check_zeropp


@dataclass(frozen=True)
class StageConfig:
    """Everything a stage needs from the DeepSpeed config, validated and typed."""
    stage: int
    model_dtype: torch.dtype
    accum_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32  # the masters' dtype (16-bit with *_master_weights_and_grads)
    states_16bit: bool = False  # bf16.bf16_optimizer_states: the optimizer state takes the masters' dtype
    comm_dtype: Optional[torch.dtype] = None  # None: communicate in the accumulation dtype
    average: bool = True  # gradient_allreduce_op "mean" (1/W folded into the factor) or "sum"
    requires_loss_scale: bool = False  # fp16: gradients must come through a loss-scaling seed
    bucket_numel: int = int(5e8)
    overlap_comm: bool = False
    use_reduce_scatter: bool = True
    offload_optimizer: Optional[str] = None  # "cpu" (also for "nvme": the host tier under the disk tier) or None
    offload_param: Optional[str] = None  # "cpu" or None (stage 3; "cpu" for "nvme" too)
    optimizer_swap: Optional[object] = None  # a swap_tensor SwapConfig: masters and moments on disk (NVMe)
    param_swap: Optional[object] = None  # a swap_tensor SwapConfig: ZeRO-3's 16-bit shards on disk (NVMe)
    pin_memory: bool = False  # offload_optimizer.pin_memory: page-locked host partitions and masters
    cpu_cores_perc: float = 0.8  # offload_optimizer.cpuadam_cores_perc: cores of the host optimizer step
    offload_ratio: float = 1.0  # offload_optimizer.ratio (stage 3): share of the optimizer state kept on the host
    param_pin_memory: bool = False  # offload_param.pin_memory (stage 3): page-locked 16-bit shards
    param_buffer_count: int = 5  # offload_param.buffer_count: pinned staging buffers for unpinned shards
    param_buffer_numel: int = int(1e8)  # offload_param.buffer_size: elements per staging buffer
    zenflow: Optional[object] = None  # a ZenFlowConfig (zero_optimization.zenflow), or None
    super_offload: bool = False  # offload_optimizer.super_offload: speculative steps (stages 1-3)
    unit_numel: int = int(5e7)  # stage 3: stage3_prefetch_bucket_size
    persistence_threshold: int = int(1e5)  # stage 3: stage3_param_persistence_threshold
    muon_momentum_on_device: bool = False  # save_muon_momentum_buffer_in_memory: Muon momentum beside the model
    zeropp: ZeroPP = ZeroPP()  # stage 3: ZeRO++ (hpZ, qwZ, qgZ; zeropp.py)

    @property
    def pin_masters(self):
        """Whether the fp32 masters are built page-locked: ``pin_memory``, unless the optimizer tier takes them to
        disk at once (pinned, their freed blocks would stay cached, locked, in torch's host allocator)."""
        return self.pin_memory and self.optimizer_swap is None

    @classmethod
    def from_ds_config(cls, cfg, model_dtype):
        """The stage config of a parsed DeepSpeed config; NotImplementedError for what is not supported."""
        zero = cfg.zero_config
        stage = cfg.zero_optimization_stage
        offload_optimizer = _device_name(zero.offload_optimizer_device) if stage > 0 else "none"
        offload_param = _device_name(zero.offload_param_device) if stage == 3 else "none"
        optimizer_swap, param_swap = _swap_configs(cfg, zero, offload_optimizer, offload_param)
        if offload_optimizer == "nvme":
            offload_optimizer = "cpu"  # the host tier steps what the disk tier holds
        if offload_param == "nvme":
            offload_param = "cpu"
        check_zenflow_stage(zero.zenflow, stage, offload_optimizer)
        opt_section = zero.offload_optimizer if offload_optimizer == "cpu" else None
        super_offload = bool(opt_section is not None and opt_section.super_offload)
        if super_offload and zero.zenflow is not None:
            raise NotImplementedError("zero_optimization.offload_optimizer.super_offload (speculative steps) is "
                                      "not supported with ZenFlow; see docs/offload.md")
        if super_offload and stage == 3 and float(opt_section.ratio) < 1.0:
            raise NotImplementedError("zero_optimization.offload_optimizer.super_offload (speculative steps) on ZeRO "
                                      "stage 3 needs offload_optimizer.ratio 1 (no device share); see docs/offload.md")
        param_section = zero.offload_param if offload_param == "cpu" else None
        zeropp = check_zeropp(zero, stage, _zero_world_size() if zero.zero_hpz_partition_size > 1 else 1)
        # *_master_weights_and_grads: the window gradient takes the masters' dtype too, unless
        # data_types.grad_accum_dtype names one
        masters = master_dtype(cfg) if stage > 0 else torch.float32
        return cls(stage=stage,
                   model_dtype=model_dtype,
                   accum_dtype=cfg.grad_accum_dtype or masters,
                   master_dtype=masters,
                   states_16bit=bool(cfg.bf16_optimizer_states) and masters != torch.float32,
                   comm_dtype=communication_dtype(cfg, _sequence_parallel_size()),
                   average=cfg.gradient_allreduce_op != "sum",
                   requires_loss_scale=bool(cfg.fp16_enabled),
                   bucket_numel=int(zero.reduce_bucket_size),
                   overlap_comm=bool(zero.overlap_comm),
                   use_reduce_scatter=bool(zero.reduce_scatter),
                   offload_optimizer="cpu" if offload_optimizer == "cpu" else None,
                   offload_param="cpu" if offload_param == "cpu" else None,
                   pin_memory=bool(zero.offload_optimizer is not None and zero.offload_optimizer.pin_memory),
                   cpu_cores_perc=float(opt_section.cpuadam_cores_perc) if opt_section is not None else 0.8,
                   offload_ratio=float(opt_section.ratio) if opt_section is not None else 1.0,
                   param_pin_memory=bool(param_section is not None and param_section.pin_memory),
                   param_buffer_count=int(param_section.buffer_count) if param_section is not None else 5,
                   param_buffer_numel=int(param_section.buffer_size) if param_section is not None else int(1e8),
                   zenflow=zero.zenflow,
                   super_offload=super_offload,
                   optimizer_swap=optimizer_swap,
                   param_swap=param_swap,
                   unit_numel=max(1, int(zero.stage3_prefetch_bucket_size)),
                   persistence_threshold=int(zero.stage3_param_persistence_threshold),
                   muon_momentum_on_device=bool(zero.save_muon_momentum_buffer_in_memory),
                   zeropp=zeropp)


def communication_dtype(cfg, sequence_parallel_size):
    """The dtype gradients are reduced in (None: the accumulation dtype). With sequence parallelism it is
    ``seq_parallel_communication_data_type`` (fp32 unless set), whatever ``communication_data_type`` says, as
    upstream's engine does."""
    if sequence_parallel_size > 1:
        return cfg.seq_parallel_communication_data_type
    return cfg.communication_data_type


def _sequence_parallel_size():
    from deepspeed.utils import groups
    return groups.current_mesh().description.sequence_parallel_size


def _zero_world_size():
    """The size of the groups ZeRO shards over, from the current mesh."""
    from deepspeed.utils import groups
    return groups.current_mesh().description.sequence_data_parallel_size


def _device_name(device):
    return str(getattr(device, "value", device))


def _swap_configs(cfg, zero, offload_optimizer, offload_param):
    """The disk tiers of ``offload_optimizer`` / ``offload_param`` with ``device: nvme`` (None where not on NVMe);
    NotImplementedError for what NVMe offload does not support."""
    if "nvme" not in (offload_optimizer, offload_param):
        return None, None
    from deepspeed.runtime.swap_tensor.swap_config import aio_settings, optimizer_swap_config, param_swap_config
    aio = cfg.aio_config
    if bool(aio.get("use_gds", False)):
        raise NotImplementedError("aio.use_gds (GPUDirect Storage) is not supported: NVMe offload moves data through "
                                  "pinned host buffers; see docs/offload.md")
    settings = aio_settings(aio)
    optimizer_swap = param_swap = None
    if offload_optimizer == "nvme":
        section = zero.offload_optimizer
        unsupported = [(zero.zenflow is not None, "ZenFlow (zero_optimization.zenflow)"),
                       (bool(section.super_offload), "offload_optimizer.super_offload (speculative steps)"),
                       (float(section.ratio) < 1.0, "offload_optimizer.ratio < 1 (partial offload)")]
        for bad, what in unsupported:
            if bad:
                raise NotImplementedError(f"{what} is not supported with offload_optimizer.device 'nvme'; use device "
                                          "'cpu' for it (docs/offload.md)")
        optimizer_swap = optimizer_swap_config(section, settings, zero.sub_group_size)
    if offload_param == "nvme":
        if zero.zenflow is not None:
            raise NotImplementedError("ZenFlow (zero_optimization.zenflow) is not supported with "
                                      "offload_param.device 'nvme'; use device 'cpu' for it (docs/offload.md)")
        param_swap = param_swap_config(zero.offload_param, settings)
    return optimizer_swap, param_swap


def _registry():
    from deepspeed.runtime.zero.stage0 import Stage0
    from deepspeed.runtime.zero.stage3 import Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import PartitionedStage
    return {0: Stage0, 1: PartitionedStage, 2: PartitionedStage, 3: Stage3}


def build_stage(config, module, optimizer, clock, *, device, group, reduction=None):
    """The stage object for ``config.stage`` (see the module docstring)."""
    stages = _registry()
    if config.stage not in stages:
        raise NotImplementedError(f"zero_optimization.stage={config.stage} is not available in this release; see "
                                  f"docs/compatibility.md")
    return stages[config.stage](module, optimizer, config, clock, device=device, group=group, reduction=reduction)
