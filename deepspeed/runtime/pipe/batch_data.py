# SPDX-License-Identifier: Apache-2.0
"""The micro-batches of one pipeline batch: drawn up front, checked on every rank, handed to the instructions.

Only the stages holding the first model chunk (inputs) and the last (labels) read the data iterator.
``train_batch``/``eval_batch`` draw the batch's micro-batches there before the schedule starts, and every rank
then learns in one small all-gather whether they could: an iterator that runs out in the middle of a batch,
no iterator, a batch that is not ``(inputs, labels)``, labels missing on the last stage. Any of these raises
the same error on every rank, before any stage waits on another (upstream raises on the reading stage only
and the others wait for ever).

Each ``LoadMicroBatch`` takes the next micro-batch for its role (inputs and labels keep separate cursors, so a
stage holding both the first and the last chunk reads each micro-batch once). A schedule run without
``train_batch`` (an engine subclass calling ``_exec_schedule`` itself) draws lazily, as upstream does.
"""

import torch

import deepspeed.comm as dist
from deepspeed.runtime.pipe.module import PipelineError

OK, NO_DATA, EXHAUSTED, NOT_A_PAIR, BAD_INPUTS, NO_LABELS, FAILED = range(7)


class PipelineDataError(PipelineError, StopIteration):
    """The batch's data could not be drawn on some stage (raised on every rank). A ``StopIteration`` too, so a
    loop that ends an epoch on ``StopIteration`` keeps working."""


def _tensor_or_tuple(value):
    return torch.is_tensor(value) or (isinstance(value, (tuple, list)) and len(value) > 0
                                      and all(torch.is_tensor(t) for t in value))


class BatchData:
    """See the module docstring."""

    def __init__(self, engine):
        self.engine = engine
        self.drawn = []
        self.cursor = {"inputs": 0, "labels": 0}
        self.ready = False

    # ------------------------------------------------------------------ drawing
    def draw(self, micro_batches, needs_labels):
        """Draw ``micro_batches`` micro-batches where this rank reads data; raise on every rank if any stage could
        not (a collective over the world)."""
        engine = self.engine
        self.drawn, self.cursor, self.ready = [], {"inputs": 0, "labels": 0}, False
        first, last = engine._holds_first(None), engine._holds_last(None)
        code, detail, message = OK, 0, ""
        if first or last:
            code, detail, message = self._draw_local(micro_batches, first, last and needs_labels)
        self._agree(code, detail, message, micro_batches)
        self.ready = True

    def _draw_local(self, count, first, last):
        engine = self.engine
        if engine.data_iterator is None and engine.batch_fn is None:
            return NO_DATA, 0, ""
        try:
            for _ in range(count):
                self.drawn.append(engine._next_batch())
        except StopIteration:
            return EXHAUSTED, len(self.drawn), ""
        except Exception as exc:  # the data pipeline's own error: every rank is told which
            self.error = exc
            return FAILED, len(self.drawn), f"{type(exc).__name__}: {exc}"
        for index, batch in enumerate(self.drawn):
            if not isinstance(batch, (tuple, list)) or len(batch) < (2 if last else 1):
                return NOT_A_PAIR, index, type(batch).__name__
            if first and not _tensor_or_tuple(batch[0]):
                return BAD_INPUTS, index, type(batch[0]).__name__
            if last and batch[1] is None:
                return NO_LABELS, index, ""
        return OK, 0, ""

    def _agree(self, code, detail, message, count):
        engine = self.engine
        error = getattr(self, "error", None)
        self.error = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            mine = torch.tensor([code, detail], dtype=torch.int64, device=engine.device)
            everyone = torch.zeros(dist.get_world_size() * 2, dtype=torch.int64, device=engine.device)
            dist.all_gather_into_tensor(everyone, mine)
            verdicts = everyone.view(-1, 2).tolist()
            if not any(v[0] for v in verdicts):
                return
            messages = [None] * dist.get_world_size()
            dist.all_gather_object(messages, message)
        else:
            if code == OK:
                return
            verdicts, messages = [[code, detail]], [message]
        problems = [self._describe(rank, c, d, messages[rank], count) for rank, (c, d) in enumerate(verdicts) if c]
        raise PipelineDataError("pipeline batch not run: " + "; ".join(problems)) from error

    def _describe(self, rank, code, detail, message, count):
        engine = self.engine
        stage = engine.grid._topo.get_coord(rank).pipe if "pipe" in engine.grid._topo.get_axis_names() else 0
        where = f"rank {rank} (stage {stage})"
        if code == NO_DATA:
            return f"{where} has no data iterator (call train_batch(data_iter) or set_dataiterator/set_dataloader)"
        if code == EXHAUSTED:
            return (f"{where}: the data iterator ran out after {detail} of the batch's {count} micro-batches "
                    f"(wrap the loader in deepspeed.utils.RepeatingLoader to restart it)")
        if code == FAILED:
            return f"{where}: drawing micro-batch {detail} raised {message}"
        if code == NOT_A_PAIR:
            return (f"{where}: micro-batch {detail} is a {message}, not an (inputs, labels) pair; the data iterator "
                    f"must yield (inputs, labels) on the first and last stages")
        if code == BAD_INPUTS:
            return f"{where}: the inputs of micro-batch {detail} are a {message}, not a tensor or a tuple of tensors"
        return (f"{where}: micro-batch {detail} has no labels (None), but the last stage computes loss_fn(outputs, "
                f"labels)")

    # ------------------------------------------------------------------ the schedule's view
    def start_schedule(self):
        if not self.ready:  # a schedule run without train_batch/eval_batch: draw as instructions ask
            self.drawn, self.cursor = [], {"inputs": 0, "labels": 0}

    def end_schedule(self):
        self.ready = False

    def _next(self, role):
        index = self.cursor[role]
        self.cursor[role] += 1
        while len(self.drawn) <= index:
            self.drawn.append(self.engine._next_batch())
        return self.drawn[index]

    def inputs(self, requires_grad):
        """The next micro-batch's inputs on this device (copies; floating ones require grad if asked)."""
        batch = self._next("inputs")
        value = batch[0]
        device = self.engine.device

        def load(t):
            if not torch.is_tensor(t):
                raise PipelineError(f"pipeline inputs must be tensors, got {type(t).__name__}")
            t = t.clone().detach().to(device)
            if requires_grad and t.is_floating_point():
                t.requires_grad_(True)
            return t

        if torch.is_tensor(value):
            return load(value)
        return tuple(load(t) for t in value)

    def labels(self):
        """The next micro-batch's labels on this device."""
        batch = self._next("labels")
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise PipelineError("the data iterator must yield (inputs, labels) pairs on the last stage")
        value = batch[1]
        device = self.engine.device
        if torch.is_tensor(value):
            return value.to(device)
        if isinstance(value, (tuple, list)):
            return tuple(t.to(device).detach() if torch.is_tensor(t) else t for t in value)
        return value
