# SPDX-License-Identifier: Apache-2.0
"""Instruction execution for ``PipelineEngine``: the schedule interpreter and the handlers of its
computation instructions (load a micro-batch, forward, backward and its zero-bubble halves, the gradient
reductions, the optimizer step).

``_exec_schedule`` runs a schedule's instructions through the engine's ``_INSTRUCTION_MAP``; transfers are
queued per step (``engine_transfers``) and flushed before the next computation.
"""

from collections import OrderedDict
from types import MethodType

import torch

import deepspeed.comm as dist
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from deepspeed.runtime.backward import ownership, registry
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine_batch import BATCH_INPUT_TIMER
from deepspeed.runtime.pipe.engine_transfers import _GROUPED, _tensors
from deepspeed.runtime.pipe.module import PipelineError


class InstructionsMixin:
    """``PipelineEngine``'s schedule interpreter and computation instructions (state set up by the engine)."""

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
            loss = self._buffer_loss(buffer_id)
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

    def _buffer_loss(self, buffer_id):
        """The loss the last stage computed in this buffer (else the latest), checked to be a scalar tensor."""
        loss = self._buffer_losses.pop(buffer_id, None)
        loss = self.loss if loss is None else loss
        if not torch.is_tensor(loss) or loss.dim() != 0:
            raise PipelineError(f"the last stage's loss must be a scalar tensor to run backward, got "
                                f"{type(loss).__name__}{list(loss.shape) if torch.is_tensor(loss) else ''}")
        return loss

    def _backward_roots(self, buffer_id, chunk):
        """``(roots, root gradients)`` of this buffer's backward: the seeded loss on the last stage, else the outputs
        that require grad and the gradients received for them."""
        if self._holds_last(chunk):
            loss = self._buffer_loss(buffer_id)
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
