# SPDX-License-Identifier: Apache-2.0
"""``PipelineEngine``: runs a schedule (lists of instructions per stage) over a ``PipelineModule``.

``deepspeed.initialize`` returns it for a ``PipelineModule``. ``train_batch()`` runs one batch: the first and
last stages draw the batch's micro-batches (every rank learns at once whether they could, so bad data raises
everywhere before any stage waits on another), then the schedule's instructions run one by one through
``_INSTRUCTION_MAP`` (one method per instruction class; patchable). Consecutive transfer instructions of a
step are posted together (``p2p.Exchange``) and complete before the next computation.

The gradient contract is the backward session's. The last stage's loss is seeded like ``engine.backward``'s
(``loss * loss_scale``); a stage that is not last seeds its backward with the gradients it received
(``ownership.seed_received``), which carry the loss scale and nothing else. Every contribution then takes the
same factor ``1 / (GAS * loss_scale)`` on every stage, once; nothing is rescaled at a stage boundary. The ZeRO
stage of each pipeline stage reduces over that stage's data-parallel ranks (the mesh puts them within the
stage); tied weights are summed over the stages that hold them after that reduction, and the global norm
spans every stage, counting a tied weight once.

Upstream's engine state that downstream code reads is kept under its names (``pipe_buffers``, ``fwd_outputs``,
``micro_batches``, ``loss``, ``total_loss``, ``agg_train_loss``, ``grid``, ``num_stages``, ``stage_id``, ...).

This file holds the construction, the queries and ``train_batch``/``eval_batch``; the engine's other parts are
mixins beside it: ``engine_instructions`` (the interpreter and the computation instructions),
``engine_transfers`` (the transfer instructions and their exchange queue), ``engine_batch`` (the data iterator
and the loss reduction) and ``engine_checkpoint`` (the checkpoint hooks).
"""

import inspect
from collections import OrderedDict

import torch

import deepspeed.comm as dist
from deepspeed.comm.peer_failure import guarded
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe import p2p, schedule
from deepspeed.runtime.pipe.batch_data import BatchData
from deepspeed.runtime.pipe.engine_batch import BATCH_INPUT_TIMER, TRAIN_BATCH_TIMER, BatchMixin  # noqa: F401
from deepspeed.runtime.pipe.engine_checkpoint import CheckpointMixin
from deepspeed.runtime.pipe.engine_instructions import InstructionsMixin
from deepspeed.runtime.pipe.engine_transfers import (  # noqa: F401
    _GROUPED, PIPE_RECV_GRAD_TIMER, PIPE_RECV_INPUT_TIMER, PIPE_SEND_GRAD_TIMER, PIPE_SEND_OUTPUT_TIMER,
    TENSOR_META_SIZE, TransfersMixin, _Layout, _tensors)
from deepspeed.runtime.pipe.module import PipelineError, PipelineModule
from deepspeed.runtime.pipe.schedule_registry import build_schedule, check_schedule_support
from deepspeed.utils import groups, logger
from deepspeed.utils.timer import ThroughputTimer

TARGET_ID = -2
LOG_STAGE = -2
DATA_PARALLEL_ID = -2


def is_even(number):
    return number % 2 == 0


class PipelineEngine(BatchMixin, InstructionsMixin, TransfersMixin, CheckpointMixin, DeepSpeedEngine):
    """A training engine for pipeline (x data) parallelism; see the module docstring."""

    pipeline_parallelism = True
    ID_TO_DTYPE = p2p.ID_TO_DTYPE[:12]
    DTYPE_TO_ID = {dtype: i for i, dtype in enumerate(ID_TO_DTYPE)}

    def __init__(self, has_bool_tensors=False, *super_args, **super_kwargs):
        bound = inspect.signature(DeepSpeedEngine.__init__).bind(None, *super_args, **super_kwargs)
        kwargs = dict(bound.arguments)
        kwargs.pop("self")
        model = kwargs.get("model")
        if not isinstance(model, PipelineModule):
            raise TypeError(f"model must base PipelineModule, got {type(model).__name__}")
        mpu = kwargs.pop("mpu", None)
        if mpu is not None and mpu is not model.mpu():
            raise ValueError("mpu must be None with pipeline parallelism: the PipelineModule's grid is the mpu")
        if kwargs.get("config_class") is None:
            # The batch identity is per data-parallel replica of the pipeline.
            kwargs["config_class"] = DeepSpeedConfig(kwargs.get("config"), mpu=model.mpu())
        cfg = kwargs["config_class"]
        # Every check and the re-cut for an interleaved schedule, on every rank, before the first collective
        # of the engine.
        self_checks = _check_config(cfg, model, kwargs)
        super().__init__(**kwargs)
        self.mpu = model.mpu()
        self.has_bool_tensors = has_bool_tensors
        self.eval_return_logits = False
        self.outputs = None
        self.pipeline_enable_backward_allreduce = True
        self.enable_backward_allreduce = False
        self.log_batch_step_id = -1
        self.micro_batch_size = self.train_micro_batch_size_per_gpu()
        self.micro_batches = self.gradient_accumulation_steps()
        self.grid = self.module._grid
        self.global_rank = self.grid.get_global_rank()
        self.num_stages = self.grid.pipe_parallel_size
        self.stage_id = self.grid.get_stage_id()
        self.prev_stage = self.stage_id - 1
        self.next_stage = self.stage_id + 1
        self.data_iterator = None
        self.batch_fn = None
        self._force_grad_boundary = False
        self.is_pipe_parallel = self.grid.pipe_parallel_size > 1
        self.is_data_parallel = self.grid.data_parallel_size > 1
        self.is_model_parallel = self.grid.model_parallel_size > 1
        self.is_pipe_partitioned = False  # tensor-parallel activation partitioning (needs a model axis)
        self.is_grad_partitioned = False
        self._schedule_name = self_checks["schedule"]
        self._layout = _Layout(self.num_stages, self.stage_id, self.module._chunks)
        self.batch_timer = ThroughputTimer(None,
                                           batch_size=self.train_batch_size(),
                                           monitor_memory=False,
                                           steps_per_output=self.steps_per_print())
        self.tput_timer = ThroughputTimer(None, batch_size=self.train_batch_size(), monitor_memory=False)
        if self.training_dataloader is not None:
            self._build_data_iter(self.training_dataloader.dataloader.dataset)
        self._configure_stage_norm()
        self._configure_checkpointing()
        self.module.checkpoint_parallel_write_pipeline = self._config.checkpoint_parallel_write_pipeline
        self.has_attention_mask = self.module.__class__.__name__ == "GPT2ModelPipe"
        self.dynamic_shape = self.module.dynamic_shape
        self._transfer_group = p2p.init_process_groups(self.grid) if self.is_pipe_parallel else None
        # Pipeline buffers (upstream's keys) and the state of one batch.
        self.num_pipe_buffers = 0
        self.pipe_buffers = {"inputs": [], "labels": [], "outputs": [], "output_tensors": []}
        self.pipe_recv_buf = None
        self.grad_layer = None
        self._grad_layer_buf = []
        self.meta_buffer = None
        self.first_output_send = True
        self.first_gradient_send = True
        self.pipe_partition_input_meta_cache = None
        self.pipe_partition_output_meta_cache = None
        self.pipe_partition_grad_meta_cache = None
        self.grad_partition_grad_layer_meta_cache = None
        self.loss = torch.tensor(0.0, device=self.device)
        self.total_loss = None
        self.total_additional_losses = None
        self.agg_loss = torch.tensor(0.0, device=self.device)
        self.dp_group_loss = torch.tensor(0.0, device=self.device)
        self.agg_train_loss = None
        self.agg_additional_losses = None
        self.fwd_outputs = []
        self._compute_loss = True
        self._known_headers = {}  # stream -> first header (without dynamic_shape)
        self._exchange = None  # transfers queued in the current group of a step
        self._in_group = False
        self._received_grads = {}  # buffer -> gradients of its outputs, from the next stage
        self._buffer_losses = {}  # buffer -> the loss computed there (last stage)
        self._split_backwards = {}  # buffer -> its backward between the input and weight halves (zero bubble)
        self._backward_total = 0
        self._backward_done = 0
        self._batch = BatchData(self)
        self._schedule = None
        if self.global_rank == 0:
            logger.info(f"PipelineEngine: {self.num_stages} stages x {self.grid.data_parallel_size} data parallel, "
                        f"micro_batches={self.micro_batches} micro_batch_size={self.micro_batch_size}, schedule "
                        f"{self._schedule_name}")

    # ------------------------------------------------------------------ construction
    def _configure_stage_norm(self):
        """The global norm spans every stage; a tied copy on a stage that does not own it is not counted."""
        if self._stage is None:
            return
        if self.is_pipe_parallel:
            self._stage.norm_group = groups._get_pipe_parallel_group()
        self._stage.norm_excluded = [p for p in self._stage.params if getattr(p, "ds_pipe_replicated", False)]

    def _configure_checkpointing(self):
        pipeline = self._config.pipeline
        if pipeline.get("use_reentrant") is False:
            self.module.activation_checkpoint_func = ds_checkpointing.non_reentrant_checkpoint
        if pipeline["activation_checkpoint_interval"] > 0:
            self.module.activation_checkpoint_interval = pipeline["activation_checkpoint_interval"]
        self.module._precompute_checkpointable_values()

    def _build_optimizer(self, client_optimizer, model_parameters):
        """As every engine's, except that a stage without trainable parameters (a parameterless layer, frozen
        layers) gets an optimizer without parameters where a torch optimizer would refuse an empty list: every
        stage takes part in the boundary step's collectives (the global norm spans the stages)."""
        params = list(model_parameters) if model_parameters is not None else list(self.module.parameters())
        # parameter groups: their parameters read twice below (a generator would be spent by the first)
        params = [
            dict(p, params=[p["params"]] if isinstance(p["params"], torch.Tensor) else list(p["params"]))
            if isinstance(p, dict) and "params" in p else p for p in params
        ]
        if (client_optimizer is None and self._config.optimizer_name is not None
                and not any(p.requires_grad for p in _flat_parameters(params))):
            return _NoParameters(dict(self._config.optimizer_params or {}))
        return super()._build_optimizer(client_optimizer, params)

    # ------------------------------------------------------------------ queries
    def is_first_stage(self):
        return self.stage_id == 0

    def is_last_stage(self):
        return self.stage_id == self.num_stages - 1

    def get_pipeline_parallel_rank(self):
        return self.stage_id

    def is_gradient_accumulation_boundary(self):
        """True while a gradient reduction or optimizer step instruction runs (as upstream)."""
        return self._force_grad_boundary

    def _loss_stage_global_rank(self):
        return self.grid.stage_to_global(self.num_stages - 1)

    def _holds_first(self, chunk):
        return self._layout.virtual_stage(0 if chunk is None else chunk) == 0

    def _holds_last(self, chunk):
        return self._layout.virtual_stage(self._layout.chunks - 1 if chunk is None else chunk) == self._layout.last

    def get_additional_losses(self):
        return self.agg_additional_losses

    def set_has_attention_mask(self, value):
        """Accepted for upstream's API; boolean tensors travel as they are here, no cast is needed."""
        if not isinstance(value, bool):
            raise TypeError(f"set_has_attention_mask expects a bool, got {type(value).__name__}")
        self.has_attention_mask = value

    def reset_activation_shape(self):
        """Forget the activation shapes seen so far: the next batch may use other shapes (the same in all of its
        micro-batches unless ``dynamic_shape``)."""
        self._known_headers = {}
        self.first_output_send = True
        self.pipe_recv_buf = None
        self.grad_layer = None
        self._grad_layer_buf = []
        self.meta_buffer = None

    def set_train_batch_size(self, train_batch_size):
        """Change the batch size by changing the number of micro-batches (the micro-batch size stays)."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size % per_step != 0:
            raise ValueError(f"Train batch size must be divisible by micro-batch data parallelism: "
                             f"{train_batch_size} % {per_step} != 0")
        gas = train_batch_size // per_step
        self._config.train_batch_size = train_batch_size
        self._config.gradient_accumulation_steps = gas
        self.window.gas = gas
        self.micro_batches = gas

    # ------------------------------------------------------------------ the batch
    def _train_schedule(self):
        return build_schedule(self._schedule_name, self.micro_batches, self.num_stages, self.stage_id,
                              self.module._chunks)

    def _inference_schedule(self, micro_batches):
        return schedule.InferenceSchedule(micro_batches=micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    @guarded("engine.train_batch")
    def train_batch(self, data_iter=None):
        """Train on the next batch (``micro_batches`` micro-batches per data-parallel replica); every stage returns
        the mean loss over the micro-batches and data-parallel replicas."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if self.optimizer is None:
            raise PipelineError("train_batch() needs an optimizer: pass one to deepspeed.initialize (or an "
                                "'optimizer' config section)")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self.total_loss = None
        self.total_additional_losses = None
        self._compute_loss = True
        self.timers(TRAIN_BATCH_TIMER).start()
        sched = self._train_schedule()
        try:
            self._batch.draw(sched.micro_batches, needs_labels=True)
            self._exec_schedule(sched)
        except BaseException:
            self._discard_batch()
            raise
        with torch.no_grad():
            self.agg_train_loss = self._aggregate_total_loss()
        self.timers(TRAIN_BATCH_TIMER).stop()
        if self.global_steps % self.steps_per_print() == 0 and self.global_rank == 0:
            elapsed = self.timers(TRAIN_BATCH_TIMER).elapsed(reset=True) / 1000.0
            logger.info(f"steps: {self.global_steps} loss: {float(self.agg_train_loss):0.4f} iter time (s): "
                        f"{elapsed / self.steps_per_print():0.3f}")
        if self.global_rank == 0 and self.monitor.enabled:
            self.summary_events = [("Train/Samples/train_loss", self.agg_train_loss.mean().item(), self.global_samples)
                                   ]
            self.monitor.write_events(self.summary_events)
        return self.agg_train_loss

    @guarded("engine.eval_batch")
    def eval_batch(self,
                   data_iter,
                   return_logits=False,
                   compute_loss=True,
                   reduce_output="avg",
                   bcast_loss=True,
                   num_micro_batches=None):
        """Forward ``num_micro_batches`` (default ``micro_batches``) micro-batches without gradients; returns the
        mean loss (on every stage with ``bcast_loss``), and the last stage's outputs with ``return_logits``."""
        self.eval_return_logits = return_logits
        self.module.eval()
        eval_output = None
        self._compute_loss = compute_loss
        train_iterator = self.data_iterator
        self.set_dataiterator(data_iter)
        micro_batches = self.micro_batches if num_micro_batches is None else num_micro_batches
        sched = self._inference_schedule(micro_batches)
        try:
            self._batch.draw(micro_batches, needs_labels=compute_loss and self.module.loss_fn is not None)
            with torch.no_grad():
                self._exec_schedule(sched)
        finally:
            self.set_dataiterator(train_iterator)
        if self.is_last_stage():
            eval_output = self._reduce_outputs(self.fwd_outputs, reduce=reduce_output, micro_batches=micro_batches)
        if compute_loss and (bcast_loss or self.monitor.enabled):
            eval_output = self._bcast_pipe_scalar(eval_output)
        if self.global_rank == 0 and self.monitor.enabled:
            self.summary_events = [("Train/Samples/eval_loss", eval_output.mean().item(), self.global_samples)]
            self.monitor.write_events(self.summary_events)
        self.eval_return_logits = False
        if return_logits:
            outputs = self.outputs
            self.outputs = None
            return eval_output, outputs
        return eval_output

    # ------------------------------------------------------------------ upstream's helpers
    def _allocate_zeros(self, shape, **kwargs):
        if "dtype" not in kwargs:
            if self.fp16_enabled():
                kwargs["dtype"] = torch.half
            if self.bfloat16_enabled():
                kwargs["dtype"] = torch.bfloat16
        return torch.zeros(shape, device=self.device, **kwargs)

    def _allocate_buffer(self, shape, num_buffers=-1, **kwargs):
        count = self.num_pipe_buffers if num_buffers == -1 else num_buffers
        return [self._allocate_zeros(shape, **kwargs) for _ in range(count)]

    def mem_status(self, msg, print_rank=-1, reset_max=False):
        """Upstream's memory debugging hook (kept for code that calls it; reports nothing)."""

    def tput_log(self, *msg):
        if self.global_rank == 0 and self.global_steps % self.steps_per_print() == 0:
            logger.info(" ".join(str(m) for m in msg))

    def log_for_device(self, *msg):
        if LOG_STAGE in (self.stage_id, -1) and DATA_PARALLEL_ID in (self.grid.data_parallel_id, -1):
            logger.info(f"RANK={dist.get_rank()} PIPE-ID={self.stage_id} DATA-ID={self.grid.data_parallel_id} :: " +
                        " ".join(str(m) for m in msg))

    # ------------------------------------------------------------------ disabled
    def forward(self, *args, **kwargs):
        """Disabled for pipeline parallel training. See ``train_batch()``."""
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def backward(self, *args, **kwargs):
        """Disabled for pipeline parallel training. See ``train_batch()``."""
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args, **kwargs):
        """Disabled for pipeline parallel training. See ``train_batch()``."""
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    # A map of instruction classes to methods; each runs with the instruction's keyword arguments.
    _INSTRUCTION_MAP = {
        schedule.OptimizerStep: InstructionsMixin._exec_optimizer_step,
        schedule.ReduceGrads: InstructionsMixin._exec_reduce_grads,
        schedule.ReduceTiedGrads: InstructionsMixin._exec_reduce_tied_grads,
        schedule.LoadMicroBatch: InstructionsMixin._exec_load_micro_batch,
        schedule.ForwardPass: InstructionsMixin._exec_forward_pass,
        schedule.BackwardPass: InstructionsMixin._exec_backward_pass,
        schedule.BackwardInputPass: InstructionsMixin._exec_backward_input_pass,
        schedule.BackwardWeightPass: InstructionsMixin._exec_backward_weight_pass,
        schedule.SendActivation: TransfersMixin._exec_send_activations,
        schedule.RecvActivation: TransfersMixin._exec_recv_activations,
        schedule.SendGrad: TransfersMixin._exec_send_grads,
        schedule.RecvGrad: TransfersMixin._exec_recv_grads,
        schedule.CommitP2P: lambda self: None,
    }


def initialize_pipeline(args, model, optimizer, model_parameters, training_data, lr_scheduler, mpu, dist_init_required,
                        collate_fn, config):
    """``deepspeed.initialize`` for a ``PipelineModule``: the same returns, a :class:`PipelineEngine`."""
    if mpu is not None:
        raise ValueError("deepspeed.initialize: mpu must be None with pipeline parallelism (a PipelineModule brings "
                         "its own grid)")
    engine = PipelineEngine(args=args,
                            model=model,
                            optimizer=optimizer,
                            model_parameters=model_parameters,
                            training_data=training_data,
                            lr_scheduler=lr_scheduler,
                            mpu=model.mpu(),
                            dist_init_required=dist_init_required,
                            collate_fn=collate_fn,
                            config=config)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _flat_parameters(params):
    """The parameters of ``model_parameters``: tensors, or parameter groups (dicts holding ``params``)."""
    for item in params:
        if isinstance(item, dict):
            yield from item.get("params", ())
        else:
            yield item


class _NoParameters(torch.optim.Optimizer):
    """The optimizer of a pipeline stage that has no trainable parameters: no groups, a step that does nothing."""

    def __init__(self, defaults):
        self.defaults = defaults
        self.state = {}
        self.param_groups = []
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    def step(self, closure=None):
        return None


def _check_config(cfg, model, kwargs):
    """Checks every rank makes alike before the engine's first collective; re-cuts the module for an
    interleaved schedule. Returns ``{"schedule": name}``."""
    pipeline = cfg.pipeline
    name = pipeline["schedule"]
    grid = model.mpu()
    if grid.model_parallel_size > 1:
        raise NotImplementedError("pipeline parallelism with a 'model' (tensor-parallel) axis is not supported for "
                                  "training yet; see docs/compatibility.md")
    if getattr(cfg, "eigenvalue_enabled", False):
        raise NotImplementedError("the eigenvalue monitor is not supported with pipeline parallelism")
    if not cfg.managed_gradient_accumulation:
        raise NotImplementedError("managed_gradient_accumulation=false is not supported with pipeline parallelism: "
                                  "train_batch() runs a whole batch")
    writer = (cfg.checkpoint_config or {}).get("writer")
    if writer is not None and writer.get("decoupled"):
        raise NotImplementedError("checkpoint.writer.decoupled (checkpoints written behind training) is not supported "
                                  "with pipeline parallelism: a pipeline engine writes its layer files synchronously; "
                                  "see docs/compatibility.md")
    chunks = pipeline["virtual_stages"] if name == "interleaved_1f1b" else 1
    check_schedule_support(name, model, cfg, chunks)
    if chunks != model._chunks:
        if kwargs.get("model_parameters") is not None or isinstance(kwargs.get("optimizer"), torch.optim.Optimizer):
            raise ValueError(f"pipeline.schedule '{name}' cuts the model into {chunks} chunks per stage at "
                             f"deepspeed.initialize, which rebuilds the stage's layers: pass the optimizer as a "
                             f"callable or a config section, and no model_parameters")
        model._set_chunks(chunks)
    return {"schedule": name}
