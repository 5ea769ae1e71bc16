# SPDX-License-Identifier: Apache-2.0
"""DeepSpeedEngine: wires config, backward session, precision and ZeRO stage together.

The engine is a conductor. It holds no gradient state: gradients live in the ZeRO
stage's gradient pipeline, the state of one backward lives in its session, the loss
scale in the scaler, the boundary step in :class:`EngineOptimizer`, where the window
ends in the :class:`~deepspeed.runtime.engine_parts.accumulation.AccumulationWindow` (native,
Accelerate and unmanaged protocols; ``no_sync`` and ``coalesce_grad_reduction``). What
the engine keeps is the step protocol's counters.
"""

import contextlib
import logging

import torch

import deepspeed.comm as dist
from deepspeed.comm.peer_failure import guarded
from deepspeed.accelerator import get_accelerator
from deepspeed.ops import grad_ops_native
from deepspeed.moe import autoep
from deepspeed.moe.utils import configure_moe_param_groups
from deepspeed.runtime import lr_schedules, torch_autocast
from deepspeed.runtime.configuration import agreement
from deepspeed.runtime.engine_parts import lifecycle as engine_lifecycle, mesh as engine_mesh
from deepspeed.runtime.engine_parts.accumulation import AccumulationWindow
from deepspeed.runtime.audit import AuditSchedule, auditing
from deepspeed.runtime.backward import ownership, registry
from deepspeed.runtime.checkpoint.engine_mixin import CheckpointEngineMixin
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.dataloader import DeepSpeedDataLoader
from deepspeed.runtime.engine_parts.api import EngineAPI
from deepspeed.runtime.engine_parts.names import refuse_unresolved
from deepspeed.runtime.engine_parts.states import EngineStates
from deepspeed.runtime.engine_parts.instrumentation import EngineInstrumentation
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from deepspeed.runtime.engine_parts.optimizer_factory import build_optimizer, check_client_offload_optimizer
from deepspeed.runtime.precision.low_precision_masters import cpu_adam_params
from deepspeed.runtime.precision.loss_scaler import create_loss_scaler
from deepspeed.runtime.keep_in_fp32 import keep_in_fp32_pattern
from deepspeed.runtime.precision import module_cast
from deepspeed.runtime.precision.overflow import report_skipped_step
from deepspeed.runtime.engine_parts.returned_optimizers import build_returned_optimizer, returned_optimizer_class
from deepspeed.runtime.tensor_parallel.training import TensorParallelTraining
from deepspeed.runtime.engine_parts.unused_parameters import UnusedParameterCheck
from deepspeed.runtime.engine_parts.usage_errors import EngineUsageError, require_scalar_loss
from deepspeed.runtime.zenflow.config import accumulation_steps as zenflow_accumulation_steps
from deepspeed.runtime.zero.stages import StageConfig, build_stage
from deepspeed.utils import groups
from deepspeed.utils.logging import log_dist, set_log_level_from_string
from deepspeed.utils.z3_leaf_module import apply_zero_leaf_module_config


class DeepSpeedEngine(EngineAPI, CheckpointEngineMixin, torch.nn.Module):
    """A model wrapped for DeepSpeed training (see the module docstring)."""

    # upstream's flag: True for the engine of a PipelineModule (PipelineEngine)
    pipeline_parallelism = False

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
        if not dist.is_initialized():
            dist.init_distributed(dist_init_required=dist_init_required)
        self._config = config_class if config_class is not None else DeepSpeedConfig(config, mpu=mpu)
        self.config = self._config._param_dict
        cfg = self._config

        if cfg.log_level is not None:  # the config's "log_level" sets the DeepSpeed logger, as upstream
            set_log_level_from_string(cfg.log_level)
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = dist.get_local_rank()
        # Every rank, before any collective: the AutoEP section and the mesh's sizes.
        autoep_config = autoep.configure_autoep(cfg, model, mpu, self.world_size)
        self._tensor_parallel = TensorParallelTraining.configure(cfg, model, mpu, self.world_size)
        tp_size = self._tensor_parallel.size if self._tensor_parallel is not None else 1
        if tp_size > 1 and autoep_config is not None:
            raise NotImplementedError(
                "AutoEP (expert_parallel) together with tensor parallelism is not supported; see "
                "docs/tensor_parallel.md")
        expert_sizes = engine_mesh.check_mesh_inputs(cfg, model, mpu, tp_size)
        if autoep_config is not None:
            expert_sizes = sorted(set(expert_sizes) | {autoep_config.autoep_size})
        self.device = torch.device(get_accelerator().device_name(
            self.local_rank)) if get_accelerator()._name != "cpu" else torch.device("cpu")
        # Before any other collective: ranks whose configs or models differ would hang or abort in one.
        agreement.check_ranks_agree(cfg,
                                    model,
                                    optimizer is not None or cfg.optimizer_name is not None,
                                    self.device,
                                    model_key=engine_mesh.model_key(model))
        self._validate_supported(cfg)
        self._compile = cfg.compile_settings
        self._client_optimizer = optimizer
        # The one mesh of this run: every group, and over which one each parameter is reduced.
        self.mesh = engine_mesh.build_engine_mesh(cfg, model, mpu, self.device, expert_sizes, tp_size)
        if self._tensor_parallel is not None:  # the model's linear layers are cut over the tensor-parallel group
            self._tensor_parallel.shard(model, self.mesh, self.device)
        self.dp_world_size = self.mesh.description.data_parallel_size
        self.seq_dp_world_size = self.mesh.description.sequence_data_parallel_size
        self.mp_world_size = self.mesh.description.model_parallel_size
        self.data_parallel_group = engine_mesh.dense_group(self.mesh)  # None: the default group
        ds_checkpointing.configure_from_engine(cfg, mpu)  # the activation_checkpointing section, if given
        self._reduction_plan = engine_mesh.reduction_plan(self.mesh)
        if autoep_config is not None:  # the model's sparse blocks get this rank's experts, grouped
            model_parameters = autoep.install_autoep(autoep_config, model, optimizer, model_parameters)
        grad_ops_native.register(self.device)  # native kernels where selected (DS_NATIVE_GRAD_OPS)

        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        # ZenFlow steps every micro-batch, as upstream: its host window replaces gradient accumulation.
        gas = zenflow_accumulation_steps(cfg.zero_config.zenflow if cfg.zero_enabled else None,
                                         cfg.gradient_accumulation_steps)
        self.window = AccumulationWindow(gas, cfg.managed_gradient_accumulation)
        self._step_applied = False
        self._warned_empty_step = False
        self._is_compiled = False
        self._unmanaged_micro_batches = 0  # engine.backward/engine.scale calls since the last step()

        self.module = model
        # Monitor, timers, comms logger, flops profiler, eigenvalue: set up (and checked on every rank) before the
        # first collective.
        self._instruments = EngineInstrumentation(self)
        self.monitor = self._instruments.monitor
        self.timers = self._instruments.timers.timers
        self.flops_profiler = self._instruments.flops_profiler
        self.eigenvalue = self._instruments.eigenvalue
        self._prepare_module(model, dont_change_device)
        if self._tensor_parallel is not None:  # which replicated parameters act on sharded activations
            self._tensor_parallel.classify(self.module, self.device)
        self.loss_scaler = create_loss_scaler(cfg.fp16_enabled, cfg.loss_scale, cfg.dynamic_loss_scale_args)

        self._torch_autocast_dtype = None
        if cfg.torch_autocast_enabled:
            self._torch_autocast_dtype = torch_autocast.resolve_autocast_dtype(cfg.torch_autocast_dtype)
            torch_autocast.init_autocast_params(self, self._torch_autocast_dtype,
                                                self.torch_autocast_lower_precision_safe_modules())
        self.basic_optimizer = self._build_optimizer(optimizer, model_parameters)
        self.optimizer = None
        self._stage = None
        self._ownership = None
        if self.basic_optimizer is not None:
            self._configure_stage()
            self._instruments.attach_stage(self._stage)
        elif cfg.zero_optimization_stage == 3:
            self._configure_stage()
        self._states = EngineStates(self)  # offload_states / reload_states (engine_parts/states.py)
        if self.optimizer is not None:
            self.optimizer.engine_states = self._states
        self._audit = AuditSchedule(self, cfg.gradient_audit_config)
        self.lr_scheduler = self._build_lr_scheduler(lr_scheduler)
        self.training_dataloader = self.deepspeed_io(training_data, collate_fn=collate_fn) \
            if training_data is not None else None
        if self._stage is not None and self.training_dataloader is not None:
            self._stage.set_epoch_length(len(self.training_dataloader) // max(1, self.gradient_accumulation_steps()))
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
        self._assert_valid_mixed_precision_config()
        apply_zero_leaf_module_config(model, cfg.zero_config.leaf_module)
        if not dont_change_device:
            model.to(self.device)
        if self._dtype != torch.float32:  # fp32 training casts nothing, buffer_dtype included (as upstream)
            keep_pattern = keep_in_fp32_pattern(model, cfg.keep_in_fp32_modules, self._dtype)
            self._cast_module_mixed_precision(*self._mixed_precision_dtypes(),
                                              is_zero_init_model=False,
                                              keep_pattern=keep_pattern)
        self._broadcast_model()

    # Upstream's names for the precision cast (runtime/precision/module_cast.py); tests call them on stand-ins.
    def _mixed_precision_dtypes(self):
        return module_cast.mixed_precision_dtypes(self.fp16_enabled(), self.bfloat16_enabled(),
                                                  self._config.buffer_dtype)

    def _assert_valid_mixed_precision_config(self):
        module_cast.check_param_dtype(self._config.param_dtype, self.fp16_enabled(), self.bfloat16_enabled())

    def _cast_module_mixed_precision(self, param_dtype, buffer_dtype, is_zero_init_model, keep_pattern=None):
        """Cast the module's parameters (unless ``zero.Init`` already chose their dtype) and, when
        ``buffer_dtype`` is set, its buffers; buffers matching ``keep_pattern`` stay fp32."""
        module_cast.cast_for_precision(self.module, None if is_zero_init_model else param_dtype, buffer_dtype,
                                       keep_pattern)

    def _broadcast_model(self):
        """Start every rank from the same parameters and buffers (experts: their expert-data-parallel peers')."""
        engine_mesh.broadcast_model(self.module, self.mesh)

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
            if self.mesh.description.expert_parallel_sizes:  # experts in param groups of their own, as upstream
                params = configure_moe_param_groups(list(params))
            if str(cfg.optimizer_name).lower() == "muon":  # which parameters are Muon's: upstream's rule, by name
                from deepspeed.ops.muon import tag_muon_params
                tag_muon_params(self.module)
            cpu_optimizer = self._offload_optimizer_device() in ("cpu", "nvme")
            optimizer_params = dict(cfg.optimizer_params or {})
            if cpu_optimizer:  # bf16.bf16_optimizer_states: the host Adam keeps bf16 moments
                optimizer_params = cpu_adam_params(cfg, cfg.optimizer_name, optimizer_params)
            return build_optimizer(cfg.optimizer_name,
                                   params,
                                   optimizer_params,
                                   self.device.type,
                                   cpu_optimizer=cpu_optimizer)
        if isinstance(client_optimizer, torch.optim.Optimizer):
            built = client_optimizer
        elif callable(client_optimizer):
            built = client_optimizer(params)
            if not isinstance(built, torch.optim.Optimizer):
                raise TypeError(f"the optimizer callable returned {type(built).__name__}, not a torch optimizer")
        else:
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable(params), not "
                            f"{type(client_optimizer).__name__}")
        check_client_offload_optimizer(built, self._offload_optimizer_device(), cfg.zero_force_ds_cpu_optimizer)
        torch_muon = getattr(torch.optim, "Muon", None)
        if cfg.zero_optimization_stage > 0 and torch_muon is not None and isinstance(built, torch_muon):
            # ZeRO 1-3 step flat partitions: torch's Muon maths, run on whole matrices by the stage's matrix step
            from deepspeed.ops.muon import PartitionedTorchMuon
            built = PartitionedTorchMuon(built)
        return built

    def _offload_optimizer_device(self):
        device = self._config.zero_config.offload_optimizer_device
        return "none" if self._config.zero_optimization_stage == 0 else str(getattr(device, "value", device))

    @property
    def micro_steps(self):
        return self.window.micro_steps

    def _configure_stage(self):
        """The ZeRO stage and the optimizer ``initialize`` returns. Without an optimizer (ZeRO-3 evaluation, as
        upstream's parameter-offload-only engine) the stage gets an internal optimizer with no parameters: every
        parameter is frozen, the stage partitions and gathers them around each forward and steps nothing, and
        ``engine.optimizer`` stays None."""
        cfg = self._config
        inner = self.basic_optimizer
        if inner is None:
            inner = torch.optim.SGD([{"params": []}], lr=0.0)
        self._stage = build_stage(StageConfig.from_ds_config(cfg, self._dtype),
                                  self.module,
                                  inner,
                                  self.window,
                                  device=self.device,
                                  group=self.data_parallel_group,
                                  reduction=self._reduction_plan)
        self._ownership = ownership.Ownership(self._stage)
        self._unused_check = None
        if self.basic_optimizer is None:
            return
        # The optimizer's class is the one upstream returns for this configuration (isinstance checks).
        optimizer_class = returned_optimizer_class(cfg.zero_optimization_stage, self._dtype, cfg.grad_accum_dtype,
                                                   self.basic_optimizer,
                                                   self._offload_optimizer_device() != "none")
        self.optimizer = build_returned_optimizer(optimizer_class,
                                                  self.basic_optimizer,
                                                  self._stage,
                                                  self.loss_scaler,
                                                  cfg.gradient_clipping,
                                                  self.zero_grad,
                                                  check_overflow=cfg.check_grad_overflow)
        if cfg.zero_optimization_stage in (1, 2, 3) and not cfg.zero_config.ignore_unused_parameters:
            self._unused_check = UnusedParameterCheck(self.module, self.data_parallel_group, self.device)

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
                                   dp_rank=groups._get_data_parallel_rank(),
                                   dp_world_size=self.dp_world_size,
                                   drop_last=self._config.dataloader_drop_last)

    # ------------------------------------------------------------- properties
    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            refuse_unresolved(self, name)  # an upstream engine name never reaches the module
            module = super().__getattr__("module")
            return getattr(module, name)

    def _compile_settings(self):
        """The parsed ``compile`` section (configuration/compile.py)."""
        return self._compile

    def gradient_accumulation_steps(self):
        return self.window.gradient_accumulation_steps()

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

    def torch_autocast_enabled(self):
        return self._config.torch_autocast_enabled

    def torch_autocast_dtype(self):
        """The dtype forwards autocast to (``torch_autocast.dtype``, or the device's default), None when off."""
        return self._torch_autocast_dtype

    def torch_autocast_lower_precision_safe_modules(self):
        names = self._config.torch_autocast_lower_precision_safe_modules
        return torch_autocast.get_default_autocast_lower_precision_modules() if names is None else names

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

    def autotp_size(self):
        """``tensor_parallel.autotp_size`` of the config (0 or 1: no automatic tensor parallelism)."""
        return self._config.tensor_parallel_config.autotp_size

    def tensor_parallel_config(self):
        return self._config.tensor_parallel_config

    def empty_partition_cache(self):
        """Free the gathered copies of ZeRO-3 parameters nothing is using, and the allocator's cache (upstream's)."""
        if self._stage is not None:
            self._stage.empty_partition_cache()
        get_accelerator().empty_cache()

    def log_level(self):
        """The config's ``log_level`` as written (None when the config leaves the DeepSpeed logger as it is)."""
        return self._config.log_level

    def zero_gather_16bit_weights_on_model_save(self):
        return bool(self._config.zero_config.stage3_gather_16bit_weights_on_model_save)

    def was_step_applied(self):
        return self._step_applied

    def get_loss_scale(self):
        return self.loss_scaler.loss_scale

    def wall_clock_breakdown(self):
        return self._config.wall_clock_breakdown

    def get_wall_clock_timers(self):
        """``{timer name: ms}`` of the last accumulation window (empty unless ``wall_clock_breakdown``)."""
        return dict(self._instruments.timers.window)

    # --------------------------------------------------------------- boundary
    def is_gradient_accumulation_boundary(self):
        return self.window.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary):
        if not self._config.managed_gradient_accumulation:
            raise EngineUsageError("set_gradient_accumulation_boundary() cannot be used with "
                                   "managed_gradient_accumulation=false: every step() is the boundary there")
        self.window.boundary_flag = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication, inside the context."""
        if self.zero_optimization_stage() >= 2:
            raise EngineUsageError(f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO "
                                   f"stage {self.zero_optimization_stage()}: gradients are partitioned during every "
                                   "backward")
        if self.window.deferred():  # inside no_sync() or coalesce_grad_reduction() already
            raise EngineUsageError("no_sync context manager reentry is unsupported (no_sync() inside no_sync() or "
                                   "coalesce_grad_reduction())")
        with self.window.no_sync():
            yield

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        """Defer gradient reduction over every backward inside the context to one pass at its exit.

        ``step()`` inside the context, and nesting it with ``no_sync()`` or itself, raise (as upstream); so does a
        pipeline engine, whose ``train_batch()`` reduces the gradients once per batch.
        """
        if self.pipeline_parallelism:
            raise NotImplementedError("coalesce_grad_reduction is not supported with pipeline parallelism: "
                                      "train_batch() reduces the gradients once per batch")
        if self.window.deferred():
            raise EngineUsageError("coalesce_grad_reduction cannot be nested inside another no_sync context "
                                   "(no_sync() or coalesce_grad_reduction())")
        with self.window.coalesced():
            yield
        if not self.window.deferred() and self._stage is not None and self.window.at_boundary():
            self._stage.finish_window()

    # ------------------------------------------------------------ torch.compile
    def compile(self, backend=None, compile_kwargs=None, schedule=None, compiled_autograd_enabled=False):
        """Compile the wrapped module in place with ``torch.compile`` (``backend`` default: the accelerator's).

        Gradients stay exact on every stage: the engine's hooks run eagerly between compiled regions
        (ZeRO-3 gathers and releases parameters there; these are graph breaks). Compiled autograd
        and DeepCompile schedules are not supported. With ``compile.deepcompile`` true this is the compiled
        path that runs (configuration/compile.py).
        """
        if schedule is not None:
            raise NotImplementedError("engine.compile(schedule=...) (DeepCompile) is not supported; see "
                                      "docs/compatibility.md")
        if compiled_autograd_enabled:
            raise NotImplementedError("engine.compile(compiled_autograd_enabled=True) is not supported: the backward "
                                      "session keys on autograd graph tasks; see docs/compatibility.md")
        if self._is_compiled:
            return
        backend = backend or get_accelerator().get_compile_backend() or "inductor"
        self.module.compile(backend=backend, **dict(compile_kwargs or {}))
        if self._stage is not None:
            self._stage.compiled()
        self._is_compiled = True

    @property
    def is_compiled(self):
        return self._is_compiled

    # ----------------------------------------------------------- gradient audit
    def audit_gradients(self, loss_fn, micro_batches, directions=4, seed=None, tolerance=None, group_by=None):
        """Check that the window gradient is the derivative of the window's loss (see docs/audit.md).

        Call it on every rank after the window's last backward and before ``step()``;
        ``loss_fn(engine, batch)`` recomputes one micro-step's loss for each of this rank's
        ``micro_batches``. Returns an :class:`~deepspeed.runtime.audit.AuditReport`, equal on every
        rank; the gradient, the weights and the random generators are left as they were.
        """
        return self._audit.audit(loss_fn, micro_batches, directions, seed, tolerance, group_by)

    def set_audit_loss_fn(self, loss_fn):
        """The ``loss_fn(engine, batch)`` the ``gradient_audit`` config section audits with (None: none)."""
        self._audit.set_loss_fn(loss_fn)

    def record_audit_batch(self, batch):
        """Give the ``gradient_audit`` section this micro-step's batch (instead of the forward's inputs)."""
        self._audit.record(batch)

    # ----------------------------------------------------- forward / backward
    @guarded("engine.forward")  # a rank that raises makes its peers fail with its reason (docs/faults.md)
    def forward(self, *inputs, **kwargs):
        self._states.require("forward")
        registry.discard_stale_sessions()
        if self._config.fp16_enabled and self._config.fp16_auto_cast:
            inputs = _cast_floats(inputs, torch.float16)
            kwargs = _cast_floats(kwargs, torch.float16)
        self._audit.on_forward(inputs, kwargs)
        # The audit's own forward passes are not training: they are neither timed nor profiled.
        with self._instruments.forward() if not auditing() else contextlib.nullcontext():
            with torch_autocast.autocast_if_enabled(self):
                outputs = self.module(*inputs, **kwargs)
        if self._stage is not None:
            if torch.is_grad_enabled():
                ownership.arm_outputs(self._stage.pipeline, outputs)
            self._stage.after_forward()
        return outputs

    @guarded("engine.backward")
    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """Backward of ``loss`` with GAS scaling (unless ``scale_wrt_gas=False``) and fp16 loss scaling.

        Returns the loss as it counts towards the step: ``loss / GAS`` when scaling.
        """
        self._states.require("backward")
        registry.discard_stale_sessions()
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"engine.backward expects a tensor loss, got {type(loss).__name__}")
        require_scalar_loss(loss, "engine.backward")
        if not self._config.managed_gradient_accumulation:
            self._unmanaged_micro_batches += 1
        with self._instruments.backward(loss):
            if self._stage is None:
                loss.backward(retain_graph=retain_graph)
                return loss
            seeded = ownership.seed(loss, self.loss_scaler.loss_scale, scale_wrt_gas, retain_graph, "engine.backward",
                                    self._stage.pipeline)
            try:
                seeded.backward(retain_graph=retain_graph)
            except BaseException:
                registry.discard_stale_sessions()
                raise
        loss = loss.detach()
        loss = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
        self._instruments.record_loss(loss)
        return loss

    def scale(self, loss):
        """``loss`` times the fp16 loss scale, seeded so that a direct ``.backward()`` on it is exact."""
        require_scalar_loss(loss, "engine.scale")
        if not self._config.managed_gradient_accumulation:
            self._unmanaged_micro_batches += 1
        if self._stage is None:
            return loss
        return ownership.seed(loss, self.loss_scaler.loss_scale, True, False, "engine.scale", self._stage.pipeline)

    # ------------------------------------------------------------------- step
    @guarded("engine.step")
    def step(self, lr_kwargs=None):
        """End a micro-step; at the accumulation boundary apply the optimizer (see the module docstring)."""
        if self.window.deferred():
            raise EngineUsageError("It is illegal to call Engine.step() inside no_sync context manager (no_sync() or "
                                   "coalesce_grad_reduction()): leave the context first")
        self._states.require("step")
        registry.discard_stale_sessions()
        with self.window.stepping():
            boundary = self.is_gradient_accumulation_boundary()
            if boundary:
                self._audit.before_step()
            if boundary and self._stage is not None and self._stage.window_is_empty():
                self._skip_empty_step()
                return
            if boundary and getattr(self, "_unused_check", None) is not None:
                self._unused_check.check()  # ignore_unused_parameters: false (raises on every rank)
            with self._instruments.step(boundary):
                if boundary:
                    self._take_model_step(lr_kwargs)
                else:
                    self._step_applied = False
                self.window.micro_steps += 1

    def _skip_empty_step(self):
        """A boundary step with no backward in its window: as in plain torch, nothing moves (no counter either)."""
        self._step_applied = False
        if not self._warned_empty_step:
            self._warned_empty_step = True
            log_dist(
                f"engine.step() at step {self.global_steps}: no backward reached this engine since the last "
                f"step; the optimizer step is skipped (weights, optimizer state, counters and LR schedule are "
                f"unchanged). This warning is given once.",
                ranks=[0],
                level=logging.WARNING)

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
        if self._config.managed_gradient_accumulation:  # ZenFlow: a step is one micro-batch of the batch
            gas = self._config.gradient_accumulation_steps
            self.global_samples += self.train_batch_size() * self.window.gas // gas
        else:  # the caller owns the boundary: count the micro-batches of this step, as upstream
            self.global_samples += self._unmanaged_micro_batches * self.train_micro_batch_size_per_gpu() * \
                self.dp_world_size
            self._unmanaged_micro_batches = 0

    def zero_grad(self, set_to_none=True):
        """Discard the gradients of the current accumulation window (and any failed backward's state)."""
        self._states.require("zero_grad")
        registry.discard_stale_sessions()
        self._audit.discard_window()
        if getattr(self, "_unused_check", None) is not None:
            self._unused_check.reset()
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
        self._close_checkpoint_engine()  # a checkpoint written behind training finishes first
        self._instruments.close()
        if self._ownership is not None:
            self._ownership.release()
            self._ownership = None
        if getattr(self, "_unused_check", None) is not None:
            self._unused_check.remove()
            self._unused_check = None
        if self._stage is not None:
            self._stage.release()
        if self._tensor_parallel is not None:
            self._tensor_parallel.release()
        self._release_python_gc()
        engine_lifecycle.retire(self)

    # disable_python_gc (deepspeed/runtime/python_gc.py): upstream's names
    def _configure_python_gc(self):
        """``initialize`` calls it once the engine is built: automatic collection off with ``disable_python_gc``."""
        if self._config.disable_python_gc and self.__dict__.get("_python_gc_token") is None:
            from deepspeed.runtime.python_gc import python_gc_manager
            self.__dict__["_python_gc_token"] = python_gc_manager.acquire()

    def _release_python_gc(self):
        token = self.__dict__.pop("_python_gc_token", None)
        if token is not None:
            from deepspeed.runtime.python_gc import python_gc_manager
            python_gc_manager.release(token)

    def collect_python_gc(self):
        """Run Python's cyclic garbage collection now (at a step boundary the training loop picks); returns the
        number of unreachable objects found."""
        from deepspeed.runtime.python_gc import python_gc_manager
        return python_gc_manager.collect()


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
