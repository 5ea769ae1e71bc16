# SPDX-License-Identifier: Apache-2.0
"""Schedules as data: what each pipeline stage does, step by step, as lists of instructions.

A :class:`PipeSchedule` yields, for one stage, a list of :class:`PipeInstruction` per step; the
pipeline engine runs each instruction through ``PipelineEngine._INSTRUCTION_MAP`` (one method per
instruction class; code that adds or replaces instructions patches that map). A schedule is pure: it
can be listed, printed and checked before anything runs (``schedule_check``: every rank's lists
together never deadlock, every micro-batch's forward precedes its backward, sends and receives pair
up).

The instructions and :class:`TrainSchedule` / :class:`InferenceSchedule` are upstream's (the default
schedule is upstream's synchronous 1F1B, step for step). Our additions: an optional ``chunk`` keyword on
the buffer instructions (which of a rank's model chunks an instruction concerns: interleaved schedules),
and the split backward of zero-bubble schedules (:class:`BackwardInputPass`, :class:`BackwardWeightPass`).
The interleaved and zero-bubble schedules live in ``interleaved.py`` and ``zero_bubble.py``.
"""

from abc import ABC, abstractmethod

from deepspeed.runtime.utils import call_to_str


def _is_even(x):
    return x % 2 == 0


def _is_odd(x):
    return x % 2 != 0


class PipeSchedule(ABC):
    """The instructions of one stage: ``steps()`` yields a list of :class:`PipeInstruction` per step.

    Each step is atomic: a barrier between two steps of every stage never deadlocks.

    Args:
        micro_batches (int): micro-batches in one batch.
        stages (int): pipeline stages.
        stage_id (int): the stage whose instructions this schedule yields.
    """

    def __init__(self, micro_batches, stages, stage_id):
        super().__init__()
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = self.stage_id - 1
        self.next_stage = self.stage_id + 1

    @abstractmethod
    def steps(self):
        """Yield a list of :class:`PipeInstruction` for each step of the schedule."""

    def num_pipe_buffers(self):
        """The number of pipeline buffers this stage uses (default: one per micro-batch)."""
        return self.micro_batches

    # Model chunks per stage: 1 for upstream's schedules. A schedule with more says where each chunk sits in the
    # chain of virtual stages; instructions name their chunk with ``chunk=`` (absent means chunk 0).
    chunks = 1

    @property
    def virtual_stages(self):
        """The length of the chain of model chunks, first to last."""
        return self.stages * self.chunks

    def virtual_stage(self, chunk=0):
        """The position of this stage's ``chunk`` in the chain (round robin: chunk ``c`` of stage ``s`` is
        ``c * stages + s``)."""
        return chunk * self.stages + self.stage_id

    def owner(self, virtual_stage):
        """``(stage, chunk)`` holding ``virtual_stage``."""
        return virtual_stage % self.stages, virtual_stage // self.stages

    def _valid_micro_batch(self, micro_batch_id):
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id):
        return 0 <= stage_id < self.stages

    @property
    def stage(self):
        return self.stage_id

    @property
    def num_stages(self):
        return self.stages

    @property
    def num_micro_batches(self):
        return self.micro_batches

    @property
    def is_first_stage(self):
        return self.stage_id == 0

    @property
    def is_last_stage(self):
        return self.stage_id == self.stages - 1

    def _buffer_idx(self, micro_batch_id):
        """The buffer of ``micro_batch_id``: buffers are used cyclically."""
        assert self._valid_micro_batch(micro_batch_id)
        return micro_batch_id % self.num_pipe_buffers()

    def __iter__(self):
        self.it = None
        return self

    def __next__(self):
        if self.it is None:
            self.it = self.steps()
        return next(self.it)


class InferenceSchedule(PipeSchedule):
    """Forward passes only: ``micro_batches + stages - 1`` steps, two buffers (receive into one, send the other)."""

    def steps(self):
        for step_id in range(self.micro_batches + self.stages - 1):
            cmds = []
            micro_batch_id = step_id - self.stage_id
            # Even stages receive into the buffer of the step's parity and send the other; odd stages the reverse.
            if _is_even(self.stage_id):
                recv_buf, send_buf = step_id % 2, (step_id + 1) % 2
            else:
                recv_buf, send_buf = (step_id + 1) % 2, step_id % 2
            if (self.is_first_stage or self.is_last_stage) and self._valid_micro_batch(micro_batch_id):
                cmds.append(LoadMicroBatch(recv_buf))
            send = self._valid_stage(self.next_stage) and self._valid_micro_batch(micro_batch_id - 1)
            recv = self._valid_stage(self.prev_stage) and self._valid_micro_batch(micro_batch_id)
            # Even stages send first, odd stages receive first: blocking transfers pair up.
            if _is_even(self.stage_id):
                cmds += [SendActivation(send_buf)] if send else []
                cmds += [RecvActivation(recv_buf)] if recv else []
            else:
                cmds += [RecvActivation(recv_buf)] if recv else []
                cmds += [SendActivation(send_buf)] if send else []
            if self._valid_micro_batch(micro_batch_id):
                cmds.append(ForwardPass(recv_buf))
            yield cmds

    def num_pipe_buffers(self):
        return 2


class TrainSchedule(PipeSchedule):
    """Synchronous 1F1B: ``2 * (micro_batches + stages - 1)`` steps, alternately forward and backward.

    A stage does a forward in the steps of its own parity and a backward in the others; the exchange
    with its neighbours happens at the start of each step (the previous step's gradient or activation
    goes out, this step's comes in), and the last step reduces tied and data-parallel gradients and
    steps the optimizer. At most ``stages - stage_id`` micro-batches are in flight on a stage.
    """

    def steps(self):
        prev_micro_batch_id = -1
        total_steps = 2 * (self.micro_batches + self.stages - 1)
        for step_id in range(total_steps):
            micro_batch_id, is_forward = self._step_to_micro_batch(step_id)
            prev_valid = self._valid_micro_batch(prev_micro_batch_id)
            curr_valid = self._valid_micro_batch(micro_batch_id)
            prev_buffer = self._buffer_idx(prev_micro_batch_id) if prev_valid else None
            curr_buffer = self._buffer_idx(micro_batch_id) if curr_valid else None
            cmds = []
            if is_forward:
                # the previous step was a backward: its gradient goes to the previous stage
                if prev_valid and self._valid_stage(self.prev_stage):
                    cmds.append(SendGrad(prev_buffer))
                if curr_valid and self._valid_stage(self.prev_stage):
                    cmds.append(RecvActivation(curr_buffer))
            else:
                if curr_valid and self._valid_stage(self.next_stage):
                    cmds.append(RecvGrad(curr_buffer))
                # the previous step was a forward: its activation goes to the next stage
                if prev_valid and self._valid_stage(self.next_stage):
                    cmds.append(SendActivation(prev_buffer))
            if (self.is_first_stage or self.is_last_stage) and is_forward and curr_valid:
                cmds.append(LoadMicroBatch(curr_buffer))
            if curr_valid:
                cmds.append(ForwardPass(curr_buffer) if is_forward else BackwardPass(curr_buffer))
            if step_id == total_steps - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            prev_micro_batch_id = micro_batch_id
            yield cmds

    def num_pipe_buffers(self):
        """The most micro-batches in flight on this stage (at least two)."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def _step_to_micro_batch(self, step_id):
        """``(micro-batch, is_forward)`` of ``step_id`` on this stage (the micro-batch may be out of range)."""
        if _is_even(step_id) == _is_even(self.stage_id):
            return (self._even_step_forward_id(step_id)
                    if _is_even(step_id) else self._odd_step_forward_id(step_id)), True
        return (self._even_step_backward_id(step_id)
                if _is_even(step_id) else self._odd_step_backward_id(step_id)), False

    # Forward in step s on stage k: micro-batch s // 2 - k // 2; backward: s // 2 - stages + 1 + k // 2.
    def _even_step_forward_id(self, step_id):
        return int(step_id // 2 - self.stage_id // 2)

    def _odd_step_forward_id(self, step_id):
        return int((step_id - 1) // 2 - self.stage_id // 2)

    def _even_step_backward_id(self, step_id):
        return int(step_id // 2 - self.stages + (self.stage_id + 1) // 2)

    def _odd_step_backward_id(self, step_id):
        return int((step_id - 1) // 2 - self.stages + 1 + self.stage_id // 2)


class DataParallelSchedule(PipeSchedule):
    """Data parallelism with gradient accumulation, as a schedule (an example: one stage, one buffer)."""

    def steps(self):
        for step_id in range(self.micro_batches):
            cmds = [LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0), BackwardPass(buffer_id=0)]
            if step_id == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self):
        return 1


class PipeInstruction:
    """One instruction for the pipeline engine; its keyword arguments are kept as attributes and in ``kwargs``."""

    def __init__(self, **kwargs):
        self.name = self.__class__.__name__
        self.kwargs = kwargs
        for key, val in kwargs.items():
            setattr(self, key, val)

    def __repr__(self):
        return call_to_str(self.name, **self.kwargs)

    def __eq__(self, other):
        return type(self) is type(other) and self.kwargs == other.kwargs

    def __hash__(self):
        return hash((type(self), tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Step the optimizer and zero the gradients (after :class:`ReduceTiedGrads` and :class:`ReduceGrads`)."""


class ReduceGrads(PipeInstruction):
    """Reduce the gradients over the data-parallel ranks of this stage."""


class ReduceTiedGrads(PipeInstruction):
    """Reduce the gradients of tied weights over the stages that hold them (every stage takes part)."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on pipeline buffer ``buffer_id`` (and, for interleaved schedules, model chunk ``chunk``)."""

    def __init__(self, buffer_id, **kwargs):
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Load the next micro-batch into a buffer (first stage: inputs; last stage: labels)."""


class ForwardPass(BufferOpInstruction):
    """Run the stage's layers on the buffer's inputs; on the last stage compute the loss."""


class BackwardPass(BufferOpInstruction):
    """Backward of the buffer's outputs (the loss, or the outputs with the received gradients)."""


class BackwardInputPass(BufferOpInstruction):
    """The input-gradient half of a backward (zero-bubble schedules): the gradient the previous stage needs.

    The weight gradients of the same buffer follow in a :class:`BackwardWeightPass`.
    """


class BackwardWeightPass(BufferOpInstruction):
    """The weight-gradient half of a backward, after its :class:`BackwardInputPass`."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's outputs to the next stage (paired with its :class:`RecvActivation`)."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's outputs as this buffer's inputs."""


class SendGrad(BufferOpInstruction):
    """Send the gradients of the buffer's inputs to the previous stage (paired with its :class:`RecvGrad`)."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradients of the buffer's outputs from the next stage."""


class CommitP2P(PipeInstruction):
    """Complete the transfers queued since the last one (the engine also completes them before any compute)."""


TRANSFERS = (SendActivation, RecvActivation, SendGrad, RecvGrad)
BACKWARDS = (BackwardPass, BackwardInputPass)
