# SPDX-License-Identifier: Apache-2.0
"""Ownership marks: which engine's ZeRO stage owns a parameter, and the hook that routes its gradients.

:class:`Ownership` marks each trainable parameter with the stage of the engine that
owns it (what ``deepspeed.utils.safe_get_*`` ask) and installs the one hook through
which every gradient contribution of that parameter reaches the backward session and,
from there, the stage's gradient pipeline. Parameters owned by no engine are left to
plain autograd.

The hooks here are the whole per-parameter hot path of backward; they do a dict
lookup and hand over to the session.
"""

import functools

from deepspeed.runtime.backward import registry
from deepspeed.runtime.backward.session import BackwardContractError, Seed

OWNER_ATTR = "_ds_owner_stage"


def _on_grad_accumulated(pipeline, param):
    session = registry.session_for_current_task()
    if session is not None:
        session.contribute(param, pipeline)


def _clear_published_grad(stage, grad):
    # A published reduced gradient (stage 0, fp32: p.grad is a view of the reduced
    # buffer) must not be accumulated into in place by the next backward: drop it
    # before autograd's AccumulateGrad runs, so the contribution arrives alone.
    stage.unpublish_grads()
    return None


class Ownership:
    """The marks and hooks one engine put on the parameters of its ``stage``; ``release`` removes them all."""

    def __init__(self, stage):
        self.stage = stage
        self.params = []
        self._handles = []
        pipeline = stage.pipeline
        on_grad = functools.partial(_on_grad_accumulated, pipeline)
        clear = functools.partial(_clear_published_grad, stage) if stage.publishes_grads else None
        for param in stage.params:
            owner = getattr(param, OWNER_ATTR, None)
            if owner is not None and owner is not stage:
                self.release()
                raise ValueError(f"parameter of shape {tuple(param.shape)} is already owned by another DeepSpeed "
                                 f"engine. A parameter can be trained by one engine only; pass disjoint "
                                 f"parameters (or freeze the shared ones in all but one engine).")
            setattr(param, OWNER_ATTR, stage)
            self.params.append(param)
            self._handles.append(param.register_post_accumulate_grad_hook(on_grad))
            if clear is not None:
                self._handles.append(param.register_hook(clear))

    def release(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for param in self.params:
            if getattr(param, OWNER_ATTR, None) is self.stage:
                delattr(param, OWNER_ATTR)
        self.params = []


def owner_of(param):
    """The ZeRO stage of the engine that owns ``param``, or None."""
    return getattr(param, OWNER_ATTR, None)


def arm_outputs(pipeline, outputs):
    """Hook the engine's forward outputs so a backward through them joins ``pipeline``.

    Arming never scales anything: it only makes the session learn, before any of the
    engine's parameters is reached, that this backward concerns the engine.
    """
    hook = functools.partial(_on_output_grad, pipeline)
    for tensor in tensors_in(outputs):
        if tensor.requires_grad:
            tensor.register_hook(hook)


def _on_output_grad(pipeline, grad):
    session = registry.session_for_current_task()
    if session is not None:
        session.factor_for(pipeline)


def tensors_in(obj, depth=0):
    """The tensors in a module output: a tensor, or (nested up to 3 levels) lists, tuples and dicts."""
    import torch
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item, depth + 1)


def seed(tensor, loss_scale, scale_wrt_gas, retain_graph, source, pipeline):
    """Return ``tensor * loss_scale`` carrying a hook that seeds the session.

    The returned tensor is the root of the backward, so its hook fires first in the
    graph task and records the seed; run again over a retained graph, it seeds that
    backward too.
    """
    if not tensor.requires_grad:
        raise BackwardContractError(f"{source}: the loss does not require grad (was it computed under "
                                    f"torch.no_grad(), or from an engine in eval mode with frozen parameters?)")
    scaled = tensor * loss_scale
    info = Seed(loss_scale=float(loss_scale), scale_wrt_gas=scale_wrt_gas, retain_graph=retain_graph, source=source)

    def _seed_hook(grad):
        session = registry.session_for_current_task()
        if session is not None:
            session.add_seed(info)
            session.factor_for(pipeline)  # the seeding engine takes part even if none of its params is reached
        return None

    scaled.register_hook(_seed_hook)
    return scaled


def seed_received(outputs, loss_scale, source, pipeline):
    """Roots for a backward seeded by received gradients (a pipeline stage that is not the last).

    ``outputs`` are this stage's output tensors whose gradients arrived from the next stage; those
    gradients are the derivative of the last stage's loss times ``loss_scale`` (the fp16 scale the last
    stage's seed applied) and carry nothing else, so this backward takes the same factor as the loss's:
    ``s(E) / loss_scale``, applied once per contribution by the session. Returns one root per output,
    a view of it carrying the seed hook: the roots fire first in the graph task, before any hook on the
    outputs themselves (the engine's arming hooks, ZeRO-3's pre-backward hooks), so the session opens
    seeded. ``torch.autograd.backward(roots, grads)`` runs it.
    """
    info = Seed(loss_scale=float(loss_scale), scale_wrt_gas=True, retain_graph=False, source=source)

    def _seed_hook(grad):
        session = registry.session_for_current_task()
        if session is not None:
            session.add_seed(info)
            session.factor_for(pipeline)
        return None

    roots = []
    for tensor in outputs:
        if not tensor.requires_grad:
            raise BackwardContractError(f"{source}: an output that received a gradient does not require grad")
        root = tensor.view_as(tensor)
        root.register_hook(_seed_hook)
        roots.append(root)
    return roots
