# SPDX-License-Identifier: Apache-2.0
"""DeepSpeedEngine: wires config, backward session, precision and ZeRO stage together.

The engine is a conductor. It holds no gradient state: gradients live in the stage
(the engine's gradient sink), the state of one backward lives in its session, the
loss scale in the scaler, the step pipeline in :class:`EngineOptimizer`. What the
engine keeps is the step protocol: counters, the accumulation boundary and the
contexts that defer reduction (``no_sync``, ``coalesce_grad_reduction``).

The accumulation boundary, three ways (all supported):

1. native: ``backward`` + ``step()`` every micro-batch; the boundary is
   ``(micro_steps + 1) % GAS == 0``;
2. Accelerate: ``set_gradient_accumulation_boundary(flag)`` before each backward;
3. unmanaged (``managed_gradient_accumulation: false``): backward only accumulates,
   every ``step()`` is a boundary.
"""

import contextlib
import logging

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime import agreement, engine_lifecycle, lr_schedules
from deepspeed.runtime.backward import ownership, registry
from deepspeed.runtime.checkpoint import CheckpointEngineMixin
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.dataloader import DeepSpeedDataLoader
from deepspeed.runtime.engine_optimizer import EngineOptimizer
from deepspeed.runtime.optimizer_factory import build_optimizer
from deepspeed.runtime.precision.loss_scaler import create_loss_scaler
from deepspeed.runtime.precision.overflow import report_skipped_step
from deepspeed.runtime.usage_errors import EngineUsageError, require_scalar_loss
from deepspeed.runtime.zero.stage0 import Stage0
from deepspeed.runtime.zero.stage_1_and_2 import PartitionedStage
from deepspeed.runtime.zero.stage3 import Stage3
from deepspeed.utils.logging import log_dist, logger


class DeepSpeedEngine(CheckpointEngineMixin, torch.nn.Module):
    """A model wrapped for DeepSpeed training (see the module docstring)."""

    def __init__(self,
                 args=None,
                 model=None,
                 optimizer=None,
                 model_parameters=None,
                 training_data=None,
                 lr_scheduler=None,
                 mpu=None,
                 dist_init_required=None,
                 collate_fn=None,
                 config=None,
                 config_class=None,
                 mesh_device=None,
                 dont_change_device=False):
        super().__init__()
        if model is None:
            raise ValueError("deepspeed.initialize: model is required")
        if mpu is not None:
            raise NotImplementedError("model parallelism (mpu) is not supported; see docs/compatibility.md")
        if not dist.is_initialized():
            dist.init_distributed(dist_init_required=dist_init_required)
        self._config = config_class if config_class is not None else DeepSpeedConfig(config)
        self.config = self._config._param_dict
        cfg = self._config

        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dp_world_size = self.world_size
        self.mp_world_size = 1
        self.local_rank = dist.get_local_rank()
        self.data_parallel_group = None  # the default group
        self.device = torch.device(get_accelerator().device_name(
            self.local_rank)) if get_accelerator()._name != "cpu" else torch.device("cpu")
        # Before any other collective: ranks whose configs or models differ would hang or abort in one.
        agreement.check_ranks_agree(cfg, model, optimizer is not None or cfg.optimizer_name is not None, self.device)
        self._validate_supported(cfg)

        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._boundary_flag = None
        self._in_step = False
        self._no_sync_depth = 0
        self._coalesce_depth = 0
        self._step_applied = False
        self._unmanaged_micro_batches = 0  # engine.backward/engine.scale calls since the last step()

        self.module = model
        self._prepare_module(model, dont_change_device)
        self.loss_scaler = create_loss_scaler(cfg.fp16_enabled, cfg.loss_scale, cfg.dynamic_loss_scale_args)

        self.basic_optimizer = self._build_optimizer(optimizer, model_parameters)
        self.optimizer = None
        self._stage = None
        self._ownership = None
        if self.basic_optimizer is not None:
            self._configure_stage()
        self.lr_scheduler = self._build_lr_scheduler(lr_scheduler)
        self.training_dataloader = self.deepspeed_io(training_data, collate_fn=collate_fn) \
            if training_data is not None else None
        if self.global_rank == 0:
            log_dist(
                f"DeepSpeedEngine: zero stage {self.zero_optimization_stage()}, dtype {self._dtype}, "
                f"GAS {self.gradient_accumulation_steps()}, dp world {self.dp_world_size}",
                ranks=[0])

    # ------------------------------------------------------------ construction
    @staticmethod
    def _validate_supported(cfg):
        stage = cfg.zero_optimization_stage
        if stage > 3:
            raise NotImplementedError(f"zero_optimization.stage={stage} is not available yet in this release; "
                                      f"see docs/compatibility.md")

    def _prepare_module(self, model, dont_change_device):
        cfg = self._config
        if cfg.bfloat16_enabled:
            self._dtype = torch.bfloat16
        elif cfg.fp16_enabled:
            self._dtype = torch.float16
        else:
            self._dtype = torch.float32
        if not dont_change_device:
            model.to(self.device)
        if self._dtype != torch.float32:
            model.to(self._dtype)
        self._broadcast_model()

    @torch.no_grad()
    def _broadcast_model(self):
        """Start every rank from rank 0's parameters and buffers."""
        if self.world_size == 1:
            return
        for tensor in list(self.module.parameters()) + list(self.module.buffers()):
            if not hasattr(tensor, "ds_id"):  # ZeRO-3 shards differ by rank on purpose
                dist.broadcast(tensor.data, src=0)

    def _build_optimizer(self, client_optimizer, model_parameters):
        cfg = self._config
        if client_optimizer is not None and cfg.optimizer_name is not None:
            # Upstream trains with the client optimizer then; frameworks rely on it.
            log_dist(
                f"deepspeed.initialize: both a client optimizer and a config 'optimizer' section (type "
                f"{cfg.optimizer_name}) were given; the client optimizer is used and the section is ignored",
                ranks=[0],
                level=logging.WARNING)
        params = model_parameters if model_parameters is not None else self.module.parameters()
        if client_optimizer is None:
            if cfg.optimizer_name is None:
                return None
            return build_optimizer(cfg.optimizer_name,
                                   params,
                                   dict(cfg.optimizer_params or {}),
                                   self.device.type,
                                   cpu_optimizer=self._offload_optimizer_device() == "cpu")
        if isinstance(client_optimizer, torch.optim.Optimizer):
            return client_optimizer
        if callable(client_optimizer):
            built = client_optimizer(params)
            if not isinstance(built, torch.optim.Optimizer):
                raise TypeError(f"the optimizer callable returned {type(built).__name__}, not a torch optimizer")
            return built
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable(params), not "
                        f"{type(client_optimizer).__name__}")

    def _offload_optimizer_device(self):
        device = self._config.zero_config.offload_optimizer_device
        return "none" if self._config.zero_optimization_stage == 0 else str(getattr(device, "value", device))

    def _trainable_params(self):
        seen = set()
        ordered = []
        for group in self.basic_optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad and id(param) not in seen:
                    seen.add(id(param))
                    ordered.append(param)
        # Lay parameters out in module order (closest to the reverse of backward order).
        rank = {id(p): i for i, p in enumerate(self.module.parameters())}
        ordered.sort(key=lambda p: rank.get(id(p), len(rank)))
        return ordered

    def _configure_stage(self):
        cfg = self._config
        zero = cfg.zero_config
        accum_dtype = cfg.grad_accum_dtype or torch.float32
        common = dict(accum_dtype=accum_dtype,
                      device=self.device,
                      bucket_numel=zero.reduce_bucket_size,
                      group=self.data_parallel_group,
                      average=cfg.gradient_allreduce_op != "sum",
                      comm_dtype=cfg.communication_data_type,
                      gas_fn=self.gradient_accumulation_steps,
                      requires_loss_scale=cfg.fp16_enabled)
        stage = cfg.zero_optimization_stage
        if stage == 0:
            params = self._trainable_params()
            self._stage = Stage0(params,
                                 self.basic_optimizer,
                                 reduce_in_backward_fn=self._reduce_in_backward,
                                 **common)
        elif stage == 3:
            offload = self._offload_optimizer_device()
            offload_param = str(getattr(zero.offload_param_device, "value", zero.offload_param_device))
            if "nvme" in (offload, offload_param):
                raise NotImplementedError("NVMe offload is not supported; see docs/compatibility.md")
            self._stage = Stage3(self.module,
                                 self.basic_optimizer,
                                 reduce_now_fn=self._reduce_every_backward,
                                 overlap_comm=bool(zero.overlap_comm),
                                 use_reduce_scatter=bool(zero.reduce_scatter),
                                 unit_numel=max(1, int(zero.stage3_prefetch_bucket_size)),
                                 persistence_threshold=int(zero.stage3_param_persistence_threshold),
                                 model_dtype=self._dtype,
                                 offload_optimizer_device="cpu" if offload == "cpu" else None,
                                 offload_param_device="cpu" if offload_param == "cpu" else None,
                                 pin_memory=bool(zero.offload_optimizer is not None
                                                 and zero.offload_optimizer.pin_memory),
                                 **{
                                     k: v
                                     for k, v in common.items() if k != "bucket_numel"
                                 })
            params = self._stage.layout.params
        else:
            offload = self._offload_optimizer_device()
            if offload == "nvme":
                raise NotImplementedError("offload_optimizer.device=nvme is not supported; see "
                                          "docs/compatibility.md")
            self._stage = PartitionedStage(
                self.module,
                self.basic_optimizer,
                stage=stage,
                reduce_now_fn=self._reduce_in_backward if stage == 1 else self._reduce_every_backward,
                overlap_comm=bool(zero.overlap_comm),
                use_reduce_scatter=bool(zero.reduce_scatter),
                offload_device="cpu" if offload == "cpu" else None,
                pin_memory=bool(zero.offload_optimizer is not None and zero.offload_optimizer.pin_memory),
                **common)
            params = self._stage.layout.params
        self._stage.grads.engine = self
        self.optimizer = EngineOptimizer(self.basic_optimizer,
                                         self._stage,
                                         self.loss_scaler,
                                         cfg.gradient_clipping,
                                         self.zero_grad,
                                         check_overflow=cfg.check_grad_overflow)
        self._ownership = ownership.Ownership(self._stage.grads,
                                              params,
                                              clear_published=getattr(self._stage.grads, "_publish", False))

    def _build_lr_scheduler(self, client_scheduler):
        cfg = self._config
        if client_scheduler is not None:
            if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
                return client_scheduler(self.basic_optimizer)
            return client_scheduler
        if cfg.scheduler_name is not None and self.basic_optimizer is not None:
            return lr_schedules.get_lr_scheduler_from_config(self.basic_optimizer, cfg.scheduler_name,
                                                             dict(cfg.scheduler_params or {}))
        return None

    def deepspeed_io(self,
                     dataset,
                     batch_size=None,
                     route=None,
                     pin_memory=True,
                     data_sampler=None,
                     collate_fn=None,
                     num_local_io_workers=None):
        return DeepSpeedDataLoader(dataset,
                                   batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
                                   pin_memory=pin_memory and self.device.type == "cuda",
                                   collate_fn=collate_fn,
                                   data_sampler=data_sampler,
                                   num_local_io_workers=num_local_io_workers,
                                   dp_rank=self.global_rank,
                                   dp_world_size=self.dp_world_size)

    # ------------------------------------------------------------- properties
    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = super().__getattr__("module")
            return getattr(module, name)

    def gradient_accumulation_steps(self):
        return self._config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self):
        return self._config.train_micro_batch_size_per_gpu

    def train_batch_size(self):
        return self._config.train_batch_size

    def zero_optimization_stage(self):
        return self._config.zero_optimization_stage

    def zero_optimization(self):
        return self._config.zero_enabled

    def fp16_enabled(self):
        return self._config.fp16_enabled

    def bfloat16_enabled(self):
        return self._config.bfloat16_enabled

    def managed_gradient_accumulation(self):
        return self._config.managed_gradient_accumulation

    def gradient_clipping(self):
        return self._config.gradient_clipping

    def steps_per_print(self):
        return self._config.steps_per_print

    def get_lr(self):
        if self.basic_optimizer is None:
            return []
        return [group["lr"] for group in self.basic_optimizer.param_groups]

    def get_global_grad_norm(self):
        """The gradient norm of the last boundary step (before clipping), or None before the first."""
        return self.optimizer.global_grad_norm() if self.optimizer is not None else None

    def zero_gather_16bit_weights_on_model_save(self):
        return bool(self._config.zero_config.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        """The whole 16-bit state dict of a ZeRO-3 model (a collective: call it on every rank)."""
        if self.zero_optimization_stage() != 3:
            raise RuntimeError("_zero3_consolidated_16bit_state_dict() is for ZeRO stage 3 engines")
        return self._stage.consolidated_state_dict(exclude_frozen_parameters)

    def was_step_applied(self):
        return self._step_applied

    def get_loss_scale(self):
        return self.loss_scaler.loss_scale

    # --------------------------------------------------------------- boundary
    def is_gradient_accumulation_boundary(self):
        if not self._config.managed_gradient_accumulation:
            return self._in_step
        if self._boundary_flag is None:
            return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0
        return self._boundary_flag

    def set_gradient_accumulation_boundary(self, is_boundary):
        if not self._config.managed_gradient_accumulation:
            raise EngineUsageError("set_gradient_accumulation_boundary() cannot be used with "
                                   "managed_gradient_accumulation=false: every step() is the boundary there")
        self._boundary_flag = bool(is_boundary)

    def _reduce_in_backward(self):
        """Whether a backward running now should reduce gradients (else it only accumulates)."""
        return (self._config.managed_gradient_accumulation and self._no_sync_depth == 0 and self._coalesce_depth == 0
                and self.is_gradient_accumulation_boundary())

    def _reduce_every_backward(self):
        """Stage 2 reduces in every backward unless reduction is deferred."""
        return self._no_sync_depth == 0 and self._coalesce_depth == 0

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication, inside the context."""
        if self.zero_optimization_stage() >= 2:
            raise EngineUsageError(f"no_sync() is incompatible with ZeRO stage {self.zero_optimization_stage()}: "
                                   f"gradients are partitioned during every backward")
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        """Defer gradient reduction over every backward inside the context to one pass at its exit."""
        self._coalesce_depth += 1
        try:
            yield
        finally:
            self._coalesce_depth -= 1
            if self._coalesce_depth == 0 and self._stage is not None and self._reduce_in_backward():
                self._stage.finish_window()

    # ----------------------------------------------------- forward / backward
    def forward(self, *inputs, **kwargs):
        registry.discard_stale_sessions()
        if self._config.fp16_enabled and self._config.fp16_auto_cast:
            inputs = _cast_floats(inputs, torch.float16)
            kwargs = _cast_floats(kwargs, torch.float16)
        outputs = self.module(*inputs, **kwargs)
        if self._stage is not None:
            if torch.is_grad_enabled():
                ownership.arm_outputs(self._stage.grads, outputs)
            after_forward = getattr(self._stage, "after_forward", None)
            if after_forward is not None:
                after_forward()
        return outputs

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """Backward of ``loss`` with GAS scaling (unless ``scale_wrt_gas=False``) and fp16 loss scaling.

        Returns the loss as it counts towards the step: ``loss / GAS`` when scaling.
        """
        registry.discard_stale_sessions()
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"engine.backward expects a tensor loss, got {type(loss).__name__}")
        require_scalar_loss(loss, "engine.backward")
        if not self._config.managed_gradient_accumulation:
            self._unmanaged_micro_batches += 1
        if self._stage is None:
            loss.backward(retain_graph=retain_graph)
            return loss
        seeded = ownership.seed(loss, self.loss_scaler.loss_scale, scale_wrt_gas, retain_graph, "engine.backward",
                                self._stage.grads)
        try:
            seeded.backward(retain_graph=retain_graph)
        except BaseException:
            registry.discard_stale_sessions()
            raise
        loss = loss.detach()
        return loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss

    def scale(self, loss):
        """``loss`` times the fp16 loss scale, seeded so that a direct ``.backward()`` on it is exact."""
        require_scalar_loss(loss, "engine.scale")
        if not self._config.managed_gradient_accumulation:
            self._unmanaged_micro_batches += 1
        if self._stage is None:
            return loss
        return ownership.seed(loss, self.loss_scaler.loss_scale, True, False, "engine.scale", self._stage.grads)

    # ------------------------------------------------------------------- step
    def step(self, lr_kwargs=None):
        """End a micro-step; at the accumulation boundary apply the optimizer (see the module docstring)."""
        registry.discard_stale_sessions()
        self._in_step = True
        try:
            if self.is_gradient_accumulation_boundary():
                self._take_model_step(lr_kwargs)
            else:
                self._step_applied = False
            self.micro_steps += 1
        finally:
            self._in_step = False

    def _take_model_step(self, lr_kwargs):
        applied = False
        if self.optimizer is not None:
            applied = self.optimizer.boundary_step()
            self._stage.zero_window()
        self._step_applied = applied
        if applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        elif self.optimizer is not None:
            self.skipped_steps += 1
            report_skipped_step(self.global_steps + 1, self.loss_scaler, self.get_global_grad_norm())
        self.global_steps += 1
        if self._config.managed_gradient_accumulation:
            self.global_samples += self.train_batch_size()
        else:  # the caller owns the boundary: count the micro-batches of this step, as upstream
            self.global_samples += self._unmanaged_micro_batches * self.train_micro_batch_size_per_gpu() * \
                self.dp_world_size
            self._unmanaged_micro_batches = 0
        spp = self.steps_per_print()
        if spp and self.global_rank == 0 and self.global_steps % spp == 0:
            logger.info(f"step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}")

    def zero_grad(self, set_to_none=True):
        """Discard the gradients of the current accumulation window (and any failed backward's state)."""
        registry.discard_stale_sessions()
        if self._stage is not None:
            self._stage.zero_window()
        else:
            self.module.zero_grad(set_to_none=set_to_none)

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def destroy(self):
        """Remove every hook and mark this engine put on the model and free its buffers.

        Afterwards every method of the engine and of its optimizer raises ``EngineDestroyedError``
        (``engine.module`` stays usable); calling ``destroy()`` again does nothing.
        """
        registry.discard_stale_sessions()
        if self._ownership is not None:
            self._ownership.release()
            self._ownership = None
        if self._stage is not None:
            self._stage.release()
        engine_lifecycle.retire(self)


def _cast_floats(obj, dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [_cast_floats(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj
