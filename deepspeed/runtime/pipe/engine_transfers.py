# SPDX-License-Identifier: Apache-2.0
"""Transfers between pipeline stages: the send/receive instructions of ``PipelineEngine`` and the exchange
queue behind them.

A step's consecutive transfer instructions are queued on one ``p2p.Exchange`` (``_GROUPED`` names the handlers
the interpreter groups) and complete together before the step's next computation; a handler called directly,
outside the interpreter, completes its transfer at once. ``_Layout`` maps a model chunk to the rank and chunk of
its neighbours in the chain of virtual stages.
"""

import torch

from deepspeed.runtime.pipe import p2p
from deepspeed.runtime.pipe.module import PipelineError

PIPE_SEND_OUTPUT_TIMER = "pipe_send_output"
PIPE_SEND_GRAD_TIMER = "pipe_send_grad"
PIPE_RECV_INPUT_TIMER = "pipe_recv_input"
PIPE_RECV_GRAD_TIMER = "pipe_recv_grad"

TENSOR_META_SIZE = 256


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


class TransfersMixin:
    """``PipelineEngine``'s transfer instructions and exchange queue (state set up by the engine)."""

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


_GROUPED = frozenset({
    TransfersMixin._exec_send_activations, TransfersMixin._exec_recv_activations, TransfersMixin._exec_send_grads,
    TransfersMixin._exec_recv_grads
})
