# SPDX-License-Identifier: Apache-2.0
"""The backward session: everything that lives exactly as long as one ``backward()``.

A session is opened by the first hook of a graph task that concerns an engine: the
seed hook that ``engine.backward``/``engine.scale`` put on the loss, a hook on an
engine's forward output (arming), or a parameter's post-accumulate-grad hook. Its
epilogue runs from the autograd engine's final callback of that graph task.

The session owns, for this one backward:

* the seed: the loss scale the root gradient carries and whether GAS scaling applies;
* the gradient pipelines (one per engine, ``zero/gradients/grad_pipeline.py``) that this backward
  reached, with the factor their contributions are multiplied by:
  ``factor(E) = s(E) / loss_scale`` where ``s(E) = 1/GAS_E`` (or 1 with
  ``scale_wrt_gas=False``);
* the routing of every parameter contribution to its engine's pipeline;
* the epilogue and the unwinding on failure.

A gradient pipeline provides::

    gradient_accumulation_steps: int      # GAS of its engine
    requires_loss_scale: bool             # fp16: gradients must come through a seed
    begin_backward(session, factor)       # first contribution or arming in this session
    contribute(param, grad)               # one contribution (param.grad already cleared)
    end_backward(session)                 # epilogue of this session
    abort_backward(session)               # this backward failed: drop its half-done state

Errors that make the contract impossible to honour raise :class:`BackwardContractError`.
Every rank runs the same graph, so every rank raises at the same point, before the
collective the wrong number would have gone into.
"""

from dataclasses import dataclass

from torch.autograd import Variable

from deepspeed.runtime.backward import registry


class BackwardContractError(RuntimeError):
    """A backward call whose gradients cannot be computed exactly as the contract says."""


@dataclass(frozen=True)
class Seed:
    """What the root gradient of an ``engine.backward``/``engine.scale`` loss carries."""
    loss_scale: float = 1.0
    scale_wrt_gas: bool = True
    retain_graph: bool = False
    source: str = "engine.backward"


IMPLICIT_SEED = Seed(source="loss.backward()")


class BackwardSession:
    """State of one backward call (one root autograd graph task and the tasks nested in it)."""

    def __init__(self, task_id):
        self.task_ids = [task_id]
        self.seed = None  # None: a plain loss.backward() so far
        self.nested = False  # a reentrant graph task joined (reentrant checkpointing)
        self._factors = {}  # pipeline -> factor, in order of arrival
        self._done = False

    # ------------------------------------------------------------------ opening
    def queue_epilogue(self):
        """Register the epilogue as a final callback of the running graph task."""
        Variable._execution_engine.queue_callback(self._epilogue)

    def join_nested(self, task_id):
        """A graph task started inside this backward (reentrant checkpointing) joins it."""
        self.task_ids.append(task_id)
        self.nested = True

    def add_seed(self, seed):
        """Record the seed of an ``engine.backward``/``engine.scale`` root.

        Several seeds may meet in one graph (``engine.scale(a) + engine.scale(b)``)
        as long as they agree; a graph whose parts carry different loss scales, or a
        seed arriving after unscaled contributions were already taken, cannot be
        unscaled exactly and raises.
        """
        current = self.seed if self.seed is not None else (IMPLICIT_SEED if self._factors else None)
        if current is not None and (current.loss_scale != seed.loss_scale
                                    or current.scale_wrt_gas != seed.scale_wrt_gas):
            self._fail(f"two loss scales in one backward graph: {current.source} carries loss scale "
                       f"{current.loss_scale} (scale_wrt_gas={current.scale_wrt_gas}) and {seed.source} carries "
                       f"{seed.loss_scale} (scale_wrt_gas={seed.scale_wrt_gas}). Gradients that mix them cannot be "
                       f"unscaled exactly. Call backward separately for each loss, or combine the losses before "
                       f"passing them to one engine.backward/engine.scale.")
        if self.seed is None:
            self.seed = seed

    # ------------------------------------------------------------ contributions
    def factor_for(self, pipeline):
        """The factor of ``pipeline`` in this session, joining it on first use."""
        factor = self._factors.get(pipeline)
        if factor is None:
            factor = self._join(pipeline)
        return factor

    def contribute(self, param, pipeline):
        """Hand ``param.grad`` (this graph task's contribution) to its engine's pipeline and clear it."""
        if pipeline not in self._factors:
            self._join(pipeline)
        grad = param.grad
        param.grad = None
        if grad is not None:
            pipeline.contribute(param, grad)

    def _join(self, pipeline):
        seed = self.seed if self.seed is not None else IMPLICIT_SEED
        if pipeline.requires_loss_scale and self.seed is None:
            self._fail("Loss scaling is required for this configuration (fp16), but an fp16 engine received "
                       "gradients from a plain loss.backward(): fp16 gradients must be loss-scaled to be correct. "
                       "Use engine.backward(loss), or engine.scale(loss).backward().")
        gas = pipeline.gradient_accumulation_steps
        if not seed.scale_wrt_gas:
            others = {p.gradient_accumulation_steps for p in self._factors}
            if others and others != {gas}:
                self._fail(f"engine.backward(loss, scale_wrt_gas=False) reached engines with different "
                           f"gradient_accumulation_steps ({sorted(others | {gas})}): a loss pre-divided for one "
                           f"GAS is wrong for the other. Use scale_wrt_gas=True, or equal GAS.")
            factor = 1.0 / seed.loss_scale
        else:
            factor = 1.0 / (gas * seed.loss_scale)
        pipeline.begin_backward(self, factor)
        self._factors[pipeline] = factor
        return factor

    def contribute_gradient(self, param, grad, pipeline):
        """Hand ``grad``, a contribution to ``param`` that the engine computed itself (``torch.autograd.grad`` of a
        weight-gradient pass, which accumulates into no ``.grad``), to ``pipeline``: the same path as a hook's."""
        if pipeline not in self._factors:
            self._join(pipeline)
        pipeline.contribute(param, grad)

    @property
    def pipelines(self):
        return list(self._factors)

    # ------------------------------------------------------------------ closing
    def _epilogue(self):
        if self._done:
            return
        self._done = True
        try:
            for pipeline in list(self._factors):
                pipeline.end_backward(self)
        finally:
            registry.close(self)

    def close(self):
        """Run the epilogue now (a session opened by ``registry.explicit_session``, which no graph task ends)."""
        self._epilogue()

    def abort(self):
        """Unwind this session after a failure: pipelines drop its state, the registry forgets it."""
        if self._done:
            return
        self._done = True
        try:
            for pipeline in list(self._factors):
                pipeline.abort_backward(self)
        finally:
            registry.close(self)

    def _fail(self, message):
        self.abort()
        raise BackwardContractError(message)
