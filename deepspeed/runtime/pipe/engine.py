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
"""

import inspect
from collections import OrderedDict
from types import MethodType

import torch

import deepspeed.comm as dist
from deepspeed.comm.peer_failure import guarded
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from deepspeed.runtime.backward import ownership, registry
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.dataloader import RepeatingLoader
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe import p2p, schedule
from deepspeed.runtime.pipe.batch_data import BatchData
from deepspeed.runtime.pipe.module import PipelineError, PipelineModule
from deepspeed.runtime.pipe.schedule_registry import build_schedule, check_schedule_support
from deepspeed.utils import groups, logger
from deepspeed.utils.timer import ThroughputTimer

TARGET_ID = -2
LOG_STAGE = -2
DATA_PARALLEL_ID = -2

BATCH_INPUT_TIMER = "batch_input"
TRAIN_BATCH_TIMER = "train_batch"
PIPE_SEND_OUTPUT_TIMER = "pipe_send_output"
PIPE_SEND_GRAD_TIMER = "pipe_send_grad"
PIPE_RECV_INPUT_TIMER = "pipe_recv_input"
PIPE_RECV_GRAD_TIMER = "pipe_recv_grad"

TENSOR_META_SIZE = 256


def is_even(number):
    return number % 2 == 0


def _tensors(value, what):
    """The tensors of a stage's inputs or outputs: a tensor, or a tuple/list of tensors."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)) and all(torch.is_tensor(t) for t in value):
        return list(value)
    raise PipelineError(f"pipeline {what} must be a tensor or a tuple of tensors, got {type(value).__name__}" +
                        (f" of {[type(t).__name__ for t in value]}" if isinstance(value, (tuple, list)) else ""))


class _Layout:
    """Where this rank's model chunks sit in the chain of virtual stages (round robin, as the schedules)."""

    def __init__(self, stages, stage_id, chunks):
        self.stages, self.stage_id, self.chunks = stages, stage_id, chunks

    def virtual_stage(self, chunk):
        return (chunk or 0) * self.stages + self.stage_id

    def owner(self, virtual_stage):
        return virtual_stage % self.stages, virtual_stage // self.stages

    @property
    def last(self):
        return self.stages * self.chunks - 1


class PipelineEngine(DeepSpeedEngine):
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

    def _build_data_iter(self, dataset):
        sampler = torch.utils.data.distributed.DistributedSampler(dataset,
                                                                  num_replicas=self.dp_world_size,
                                                                  rank=self.mpu.get_data_parallel_rank(),
                                                                  shuffle=False)
        self.set_dataloader(RepeatingLoader(self.deepspeed_io(dataset, data_sampler=sampler)))

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

    # ------------------------------------------------------------------ data
    def set_dataloader(self, loader):
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(self.training_dataloader)

    def set_dataiterator(self, iterator):
        """Store an iterator to sample for training data (read by the first and last stages)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_batch_fn(self, fn):
        """A function applied to every batch drawn from the data iterator."""
        self.batch_fn = fn

    def _next_batch(self):
        batch = None
        if self.data_iterator is not None:
            batch = next(self.data_iterator)
        if self.batch_fn:
            batch = self.batch_fn(batch)
        return batch

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

    def _discard_batch(self):
        """A batch that raised leaves nothing behind: no half-accumulated window, no buffers, no queued transfer
        (the next ``train_batch`` starts clean on every stage, whichever stage failed where)."""
        self._exchange, self._in_group = None, False
        self._received_grads.clear()
        self._buffer_losses.clear()
        self._split_backwards.clear()
        for key in self.pipe_buffers:
            self.pipe_buffers[key] = [None] * len(self.pipe_buffers[key])
        self.window.boundary_flag = None
        self.zero_grad()

    def _scale_loss_by_gas(self, prescaled_loss, eval_micro_batches=None):
        gas = eval_micro_batches if eval_micro_batches is not None else self.micro_batches
        if isinstance(prescaled_loss, torch.Tensor):
            return prescaled_loss / gas
        if isinstance(prescaled_loss, (tuple, list)):
            return [loss / gas if isinstance(loss, torch.Tensor) else loss for loss in prescaled_loss]
        return prescaled_loss

    def _reduce_outputs(self, outputs, reduce="avg", reduce_dp=True, micro_batches=None):
        if reduce is None:
            return outputs
        if reduce.lower() != "avg":
            raise NotImplementedError(f"reduction type {reduce} not supported.")
        if torch.is_tensor(outputs[0]):
            reduced = sum(outputs)
        else:
            reduced = [sum(out[i] for out in outputs) for i in range(len(outputs[0]))]
        reduced = self._scale_loss_by_gas(reduced, eval_micro_batches=micro_batches)
        if reduce_dp and self.is_data_parallel:
            for tensor in ([reduced] if torch.is_tensor(reduced) else reduced):
                dist.all_reduce(tensor, group=self.mpu.get_data_parallel_group())
                tensor /= self.dp_world_size
        return reduced

    def _bcast_pipe_scalar(self, data, src_rank=None, dtype=torch.float32):
        src_rank = self._loss_stage_global_rank() if src_rank is None else src_rank
        if self.global_rank == src_rank:
            result = data.clone().detach().type(dtype).to(self.device)
        else:
            result = torch.tensor([0.0], dtype=dtype, device=self.device)
        if self.is_pipe_parallel:
            result = result.reshape(1) if result.dim() == 0 and self.global_rank != src_rank else result
            if self.global_rank == src_rank:
                result = result.reshape(1)
            dist.broadcast(tensor=result, src=src_rank, group=self.mpu.get_pipe_parallel_group())
            result = result.reshape(())
        return result

    def _aggregate_total_loss(self):
        """The batch's mean loss over micro-batches and data-parallel replicas, on every stage (from the last)."""
        if self.is_last_stage():
            loss = self._scale_loss_by_gas(self.total_loss)
            self.agg_additional_losses = self.total_additional_losses
            if self.agg_additional_losses is not None:
                self.agg_additional_losses = OrderedDict((name, self._scale_loss_by_gas(value.clone().detach()))
                                                         for name, value in self.agg_additional_losses.items())
            self.dp_group_loss = loss.clone().detach().float()
            tensors = [self.dp_group_loss.reshape(-1)]
            extra = list((self.agg_additional_losses or {}).values())
            tensors += [t.detach().float().reshape(-1) for t in extra]
            flat = torch.cat(tensors)
            if self.is_data_parallel:
                dist.all_reduce(flat, group=self.mpu.get_data_parallel_group())
                flat /= self.dp_world_size
            losses = torch.cat([self.dp_group_loss.reshape(-1), flat])
            if self.is_pipe_parallel:
                dist.broadcast(tensor=losses, src=self.global_rank, group=self.mpu.get_pipe_parallel_group())
        else:
            extra = self.module.get_additional_losses()
            count = 2 + (0 if extra is None else len(extra))
            losses = torch.zeros(count, device=self.device)
            dist.broadcast(tensor=losses,
                           src=self._loss_stage_global_rank(),
                           group=self.grid.get_pipe_parallel_group())
            self.dp_group_loss = losses[0].clone()
            if extra is not None:
                self.agg_additional_losses = OrderedDict(
                    (name, losses[2 + i].clone()) for i, name in enumerate(extra.keys()))
        if self.is_last_stage() and self.agg_additional_losses is not None:
            for i, name in enumerate(list(self.agg_additional_losses)):
                self.agg_additional_losses[name] = losses[2 + i].clone()
        return losses[1].clone()

    # ------------------------------------------------------------------ the interpreter
    def _reserve_pipe_buffers(self, num_buffers):
        """Make every pipeline buffer list at least ``num_buffers`` long (slots only, no tensors)."""
        if self.num_pipe_buffers >= num_buffers:
            return
        added = num_buffers - self.num_pipe_buffers
        for key in self.pipe_buffers:
            self.pipe_buffers[key].extend([None] * added)
        self.num_pipe_buffers = num_buffers

    def _exec_schedule(self, pipe_schedule):
        """Run every instruction of ``pipe_schedule`` (see the module docstring)."""
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        self._schedule = pipe_schedule
        self._batch.start_schedule()
        self._backward_total = sum(
            isinstance(cmd, (schedule.BackwardPass, schedule.BackwardWeightPass)) for step in pipe_schedule
            for cmd in step)
        self._backward_done = 0
        try:
            for step_cmds in pipe_schedule:
                for cmd in step_cmds:
                    method = self._INSTRUCTION_MAP.get(type(cmd))
                    if method is None:
                        raise RuntimeError(f"{self.__class__.__name__} does not understand instruction {repr(cmd)}")
                    if method in _GROUPED:  # a transfer of ours: queued with the step's other transfers
                        self._in_group = True
                    else:
                        self._flush_transfers()
                        if isinstance(cmd, schedule.CommitP2P):
                            continue
                    self._exec_instr = MethodType(method, self)
                    self._exec_instr(**cmd.kwargs)
                self._flush_transfers()
        finally:
            self._in_group = False
            self._exchange = None
            self.window.boundary_flag = None
            self._schedule = None
            self._batch.end_schedule()

    def _flush_transfers(self):
        self._in_group = False
        exchange, self._exchange = self._exchange, None
        if exchange:
            exchange.flush()

    def _queue(self):
        if self._exchange is None:
            self._exchange = p2p.Exchange(self.device, self._known_headers, self.dynamic_shape, self._transfer_group)
        return self._exchange

    def _after_queue(self):
        if not self._in_group:  # called directly (not by the interpreter): a blocking transfer
            self._flush_transfers()

    # ------------------------------------------------------------------ instructions
    def _exec_load_micro_batch(self, buffer_id, chunk=None):
        if self.wall_clock_breakdown():
            self.timers(BATCH_INPUT_TIMER).start()
        if self._holds_first(chunk):
            self.pipe_buffers["inputs"][buffer_id] = self._batch.inputs(self._reentrant_activation_checkpointing())
        if self._holds_last(chunk):
            self.pipe_buffers["labels"][buffer_id] = self._batch.labels()
        if self.wall_clock_breakdown():
            self.timers(BATCH_INPUT_TIMER).stop()

    def _reentrant_activation_checkpointing(self):
        """Reentrant checkpointing needs the first stage's floating inputs to require grad."""
        if self.module.activation_checkpoint_interval <= 0:
            return False
        return self.module.activation_checkpoint_func is not ds_checkpointing.non_reentrant_checkpoint

    def _exec_forward_pass(self, buffer_id, chunk=None):
        self.tput_timer.start()
        inputs = self.pipe_buffers["inputs"][buffer_id]
        # A received activation is a leaf that collects its gradient: the forward works on a copy of it, so an
        # in-place operation of the first layer cannot touch the leaf.
        if isinstance(inputs, tuple):
            inputs = tuple(t.clone() if t.requires_grad else t for t in inputs)
        elif torch.is_tensor(inputs) and inputs.requires_grad:
            inputs = inputs.clone()
        if self.module._chunks > 1:
            self.module.set_active_chunk(chunk or 0)
        outputs = DeepSpeedEngine.forward(self, inputs)
        if not self.module.training:
            ds_checkpointing.reset()
        self.pipe_buffers["outputs"][buffer_id] = outputs
        if self._holds_last(chunk):
            self._compute_last_stage_loss(buffer_id, outputs)

    def _compute_last_stage_loss(self, buffer_id, outputs):
        if self._compute_loss and self.module.loss_fn is not None:
            self.loss = self.module.loss_fn(outputs, self.pipe_buffers["labels"][buffer_id])
        else:
            self.loss = outputs  # the model returns its loss
        self.pipe_buffers["labels"][buffer_id] = None
        if self.eval_return_logits:
            self.outputs = outputs
        if self.module.training:
            self._buffer_losses[buffer_id] = self.loss
        detached = self.loss.detach() if torch.is_tensor(self.loss) else [t.detach() for t in self.loss]
        self.fwd_outputs.append(detached)
        self.total_loss = _add_loss(self.total_loss, self.loss)
        additional = self.module.get_additional_losses()
        if additional is not None:
            if self.total_additional_losses is None:
                self.total_additional_losses = OrderedDict()
            for name, value in additional.items():
                self.total_additional_losses[name] = _add_loss(self.total_additional_losses.get(name), value)

    def _exec_backward_pass(self, buffer_id, chunk=None):
        if self.optimizer is None:
            raise PipelineError("must provide optimizer during init in order to use backward")
        self._start_backward_call()
        pipeline = self._stage.pipeline
        scale = self.loss_scaler.loss_scale
        if self._holds_last(chunk):
            loss = self._buffer_losses.pop(buffer_id, None)
            loss = self.loss if loss is None else loss
            if not torch.is_tensor(loss) or loss.dim() != 0:
                raise PipelineError(f"the last stage's loss must be a scalar tensor to run backward, got "
                                    f"{type(loss).__name__}{list(loss.shape) if torch.is_tensor(loss) else ''}")
            with self._instruments.backward(loss):
                roots = [ownership.seed(loss, scale, True, False, "the pipeline's loss (last stage)", pipeline)]
                _run_backward(roots, None)
        else:
            outputs = [t for t in _tensors(self.pipe_buffers["outputs"][buffer_id], "outputs") if t.requires_grad]
            grads = self._received_grads.pop(buffer_id, None)
            if grads is None:
                grads = self.grad_layer if torch.is_tensor(self.grad_layer) else self.grad_layer
                grads = [grads] if torch.is_tensor(grads) else list(grads or [])
            if len(grads) != len(outputs):
                raise PipelineError(f"stage {self.stage_id}: {len(outputs)} outputs require grad but {len(grads)} "
                                    f"gradients were received")
            if outputs:
                with self._instruments.backward(None):
                    roots = ownership.seed_received(outputs, scale, "the gradient received from the next stage",
                                                    pipeline)
                    _run_backward(roots, grads)
        self.pipe_buffers["outputs"][buffer_id] = None
        self.pipe_buffers["output_tensors"][buffer_id] = None
        self._end_backward_call()

    def _backward_roots(self, buffer_id, chunk):
        """``(roots, root gradients)`` of this buffer's backward: the seeded loss on the last stage, else the outputs
        that require grad and the gradients received for them."""
        if self._holds_last(chunk):
            loss = self._buffer_losses.pop(buffer_id, None)
            loss = self.loss if loss is None else loss
            if not torch.is_tensor(loss) or loss.dim() != 0:
                raise PipelineError(f"the last stage's loss must be a scalar tensor to run backward, got "
                                    f"{type(loss).__name__}{list(loss.shape) if torch.is_tensor(loss) else ''}")
            return [loss * self.loss_scaler.loss_scale], None
        outputs = [t for t in _tensors(self.pipe_buffers["outputs"][buffer_id], "outputs") if t.requires_grad]
        grads = self._received_grads.pop(buffer_id)
        if len(grads) != len(outputs):
            raise PipelineError(f"stage {self.stage_id}: {len(outputs)} outputs require grad but {len(grads)} "
                                f"gradients were received")
        return outputs, grads

    def _exec_backward_input_pass(self, buffer_id, chunk=None):
        """The input-gradient half of the buffer's backward (zero-bubble schedules; ``split_backward``)."""
        from deepspeed.runtime.pipe.split_backward import SplitBackward
        roots, grads = self._backward_roots(buffer_id, chunk)
        inputs = self.pipe_buffers["inputs"][buffer_id]
        inputs = [] if inputs is None else _tensors(inputs, "inputs")
        split = SplitBackward(roots, grads, inputs, self._stage.params if self._stage is not None else [])
        split.input_pass()
        self._split_backwards[buffer_id] = split
        self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_backward_weight_pass(self, buffer_id, chunk=None):
        """The weight-gradient half: the parameters' gradients reach the gradient pipeline through the session."""
        from deepspeed.runtime.backward.session import Seed
        split = self._split_backwards.pop(buffer_id)
        self._start_backward_call()
        seed = Seed(loss_scale=float(self.loss_scaler.loss_scale), source="a weight-gradient pass (zero bubble)")
        with self._instruments.backward(None):
            used = split.weight_pass(seed, self._stage.pipeline)
        if getattr(self, "_unused_check", None) is not None:
            self._unused_check.mark(used)
        self._end_backward_call()

    def _start_backward_call(self):
        # The stage reduces in the last backward of the batch that reaches its parameters (stages 0 and 1), as
        # DeepSpeedEngine does in the boundary micro-step; stages 2 and 3 reduce in every backward.
        self.window.boundary_flag = self._backward_done == self._backward_total - 1

    def _end_backward_call(self):
        self._backward_done += 1
        self.window.boundary_flag = False

    def _exec_reduce_tied_grads(self):
        """Sum the (data-parallel reduced) gradients of tied weights over the stages that hold them."""
        if self._stage is None:
            return
        self._stage.finish_window()
        trainable = set(self._stage.params)
        for _, weight, comm in self.module._tied_weights():
            if weight not in trainable or len(comm["ranks"]) < 2:
                continue
            grad = self._stage.full_grad(weight)
            dist.all_reduce(grad, group=comm["group"])
            self._stage.set_full_grad(weight, grad)

    def _exec_reduce_grads(self):
        self._force_grad_boundary = True
        try:
            if self.pipeline_enable_backward_allreduce and self._stage is not None:
                self._stage.finish_window()
        finally:
            self._force_grad_boundary = False

    def _exec_optimizer_step(self, lr_kwargs=None):
        self._force_grad_boundary = True
        try:
            if getattr(self, "_unused_check", None) is not None:
                self._unused_check.check()
            with self._instruments.step(True):
                self.window.boundary_flag = True
                self._take_model_step(lr_kwargs)
                self.window.micro_steps += self.micro_batches
                self.window.boundary_flag = None
        finally:
            self._force_grad_boundary = False
        if self.global_rank == 0 and self.monitor.enabled:
            self.summary_events = [("Train/Samples/lr", self.get_lr()[0], self.global_samples)]
            if self.fp16_enabled():
                self.summary_events.append(("Train/Samples/loss_scale", self.get_loss_scale(), self.global_samples))
            self.monitor.write_events(self.summary_events)

    # ------------------------------------------------------------------ transfers
    def _peer(self, chunk, towards_next):
        """The global rank holding the neighbouring model chunk, and that chunk."""
        vs = self._layout.virtual_stage(chunk)
        stage, peer_chunk = self._layout.owner(vs + 1 if towards_next else vs - 1)
        return self.grid.stage_to_global(stage_id=stage), peer_chunk

    def _exec_send_activations(self, buffer_id, chunk=None):
        value = self.pipe_buffers["outputs"][buffer_id]
        outputs = _tensors(value, "stage outputs sent to the next stage")
        dst, peer_chunk = self._peer(chunk, True)
        self._queue().send(outputs,
                           dst, ("to", dst, "act", peer_chunk),
                           with_header=True,
                           is_tensor=torch.is_tensor(value))
        self._after_queue()

    def _exec_recv_activations(self, buffer_id, chunk=None):
        src, _ = self._peer(chunk, False)
        op = self._queue().recv(src, ("from", src, "act", chunk or 0))

        def received(tensors, op=op):
            for t, (_, requires_grad, _) in zip(tensors, op.specs):
                if requires_grad and t.is_floating_point():
                    t.requires_grad_(True)
            self.pipe_buffers["inputs"][buffer_id] = tensors[0] if op.is_tensor else tuple(tensors)

        op.then = received
        self._after_queue()

    def _exec_send_grads(self, buffer_id, chunk=None):
        inputs = _tensors(self.pipe_buffers["inputs"][buffer_id], "stage inputs")
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if t.requires_grad]
        dst, peer_chunk = self._peer(chunk, False)
        self._queue().send(grads, dst, ("to", dst, "grad", peer_chunk), with_header=False)
        self.pipe_buffers["inputs"][buffer_id] = None
        self._after_queue()

    def _exec_recv_grads(self, buffer_id, chunk=None):
        outputs = [t for t in _tensors(self.pipe_buffers["outputs"][buffer_id], "stage outputs") if t.requires_grad]
        src, _ = self._peer(chunk, True)
        op = self._queue().recv(src, (src, "grad", chunk or 0),
                                specs=[(t.dtype, False, tuple(t.shape)) for t in outputs])

        def received(tensors):
            self._received_grads[buffer_id] = tensors
            self.grad_layer = tensors

        op.then = received
        self._after_queue()

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

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """Collective: upstream's pipeline layout (per-layer files, per-stage model states, ZeRO files per stage and
        data-parallel rank); see ``deepspeed/runtime/pipe/checkpoint.py``."""
        from deepspeed.runtime.pipe import checkpoint
        return checkpoint.save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self,
                        load_dir,
                        tag=None,
                        load_module_strict=True,
                        load_optimizer_states=True,
                        load_lr_scheduler_states=True,
                        load_module_only=False,
                        custom_load_fn=None):
        """Collective: load a pipeline checkpoint (this runtime's or upstream's) into any cut and data-parallel
        size; returns ``(path, client_state)`` or ``(None, None)``."""
        from deepspeed.runtime.pipe import checkpoint
        return checkpoint.load(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only, custom_load_fn)

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
        schedule.OptimizerStep: _exec_optimizer_step,
        schedule.ReduceGrads: _exec_reduce_grads,
        schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
        schedule.LoadMicroBatch: _exec_load_micro_batch,
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
        schedule.BackwardInputPass: _exec_backward_input_pass,
        schedule.BackwardWeightPass: _exec_backward_weight_pass,
        schedule.SendActivation: _exec_send_activations,
        schedule.RecvActivation: _exec_recv_activations,
        schedule.SendGrad: _exec_send_grads,
        schedule.RecvGrad: _exec_recv_grads,
        schedule.CommitP2P: lambda self: None,
    }


_GROUPED = frozenset({
    PipelineEngine._exec_send_activations, PipelineEngine._exec_recv_activations, PipelineEngine._exec_send_grads,
    PipelineEngine._exec_recv_grads
})


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


def _add_loss(total, loss):
    if torch.is_tensor(loss):
        return loss.detach().clone() if total is None else total + loss.detach()
    if total is None:
        return [t.detach().clone() for t in loss]
    return [a + b.detach() for a, b in zip(total, loss)]


def _run_backward(roots, grads):
    try:
        torch.autograd.backward(roots, grads)
    except BaseException:
        registry.discard_stale_sessions()
        raise


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
