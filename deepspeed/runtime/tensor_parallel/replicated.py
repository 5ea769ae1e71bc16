# SPDX-License-Identifier: Apache-2.0
"""Which replicated parameters act on sharded activations: one traced forward decides.

Inside a tensor-parallel group a parameter that is not cut (a norm, a row-parallel bias, an
untied embedding...) is *replicated*. With the collectives of ``mappings.py`` its local
gradient is one of two kinds:

* ``"mean"``: it only acts on replicated activations (the residual stream, the norms around a
  block, a row-parallel layer's bias added after the sum); every rank computes the whole
  gradient, the same on each;
* ``"sum"``: it acts on activations cut over the group (Qwen3's ``q_norm``/``k_norm`` normalise
  the local attention heads); each rank computes its share and the whole gradient is the sum
  over the group.

The gradient pipeline reduces both over the tensor-parallel group (with the data-parallel
reduction), dividing a ``"mean"`` gradient by the group's size, so the replicas stay equal and
equal to the unsharded model's (``engine_parts.mesh.reduction_plan``). Which kind a parameter is
follows from the data flow, not from its name, so :class:`ShardFlow` traces it: a
``TorchFunctionMode`` over one forward follows, for every tensor, whether it is sharded
(derived from a column-parallel output without passing a row-parallel sum or a gather; the
layers say so through :func:`mark`) and which replicated parameters it was computed from
while replicated. A call that combines a sharded tensor with a tensor derived from parameters
makes those parameters ``"sum"``; any other use of them, ``"mean"``. A parameter used both
ways would need a gradient that neither reduction gives, and is reported.

Cut parameters (``tensor_model_parallel``) are neither: their gradient is whole on their rank.
"""

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

SUM = "sum"
MEAN = "mean"
MARK_ATTR = "ds_tp_replicated"  # "sum" or "mean" on a replicated parameter of a tensor-parallel model

_ACTIVE = []  # the ShardFlow tracing right now (at most one)


def mark(tensor, sharded):
    """A tensor-parallel layer's output: ``sharded`` or replicated (no-op unless a forward is being traced)."""
    if _ACTIVE:
        _ACTIVE[-1].set_sharded(tensor, sharded)


def _is_cut(param):
    return bool(getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False))


def _tensors(obj):
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


class ShardFlow(TorchFunctionMode):
    """Traces one forward (module docstring). After it, :attr:`uses` maps each replicated parameter's name to the set
    of kinds it was used as (``{"sum"}``, ``{"mean"}`` or both); parameters the forward did not reach are absent."""

    def __init__(self, module):
        super().__init__()
        self.names = {p: n for n, p in module.named_parameters() if not _is_cut(p)}
        self.uses = {}
        self._sharded = set()
        self._sources = {}  # id(tensor) -> frozenset of parameter names it was computed from while replicated
        self._keep = []  # the tensors seen: their ids stay theirs while the trace lasts

    # what the layers tell -------------------------------------------------------------
    def set_sharded(self, tensor, sharded):
        self._keep.append(tensor)
        if sharded:
            self._sharded.add(id(tensor))
        else:
            self._sharded.discard(id(tensor))
        self._sources.pop(id(tensor), None)

    # the trace --------------------------------------------------------------------------
    def _sources_of(self, tensor):
        name = self.names.get(tensor) if isinstance(tensor, torch.nn.Parameter) else None
        if name is not None:
            return frozenset((name, ))
        return self._sources.get(id(tensor), frozenset())

    def _use(self, names, kind):
        for name in names:
            self.uses.setdefault(name, set()).add(kind)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        if not inputs:
            return out
        outputs = _tensors(out)
        name = getattr(func, "__name__", "")
        if name.endswith("_") or name == "__setitem__":  # in place: the first argument is an output too
            outputs = outputs + inputs[:1]
        sharded = any(id(t) in self._sharded for t in inputs)
        sources = frozenset().union(*(self._sources_of(t) for t in inputs if id(t) not in self._sharded))
        if sources:
            self._use(sources, SUM if sharded else MEAN)
        for t in outputs:
            self._keep.append(t)
            if sharded:
                self._sharded.add(id(t))
                self._sources.pop(id(t), None)
            elif sources:
                self._sources[id(t)] = sources
        return out

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        self._keep = []
        return super().__exit__(*exc)

    # the verdict --------------------------------------------------------------------------
    def kinds(self):
        """``{name: "sum" | "mean"}`` of every replicated parameter the forward reached; ValueError naming the
        parameters used both on sharded and on replicated activations."""
        mixed = sorted(name for name, kinds in self.uses.items() if len(kinds) > 1)
        if mixed:
            raise ValueError(
                f"AutoTP: parameters {mixed[:4]} are used both on activations cut over the tensor-parallel "
                f"group and on replicated ones, so their gradient cannot be reduced exactly; shard the "
                f"layers around them differently (tensor_parallel.partition_config)")
        return {name: next(iter(kinds)) for name, kinds in self.uses.items()}


def probe_inputs(module):
    """Keyword inputs for one forward of ``module`` when they can be made up (a Hugging Face model taking
    ``input_ids``), else None."""
    config = getattr(module, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if getattr(module, "main_input_name", None) != "input_ids" or not isinstance(vocab, int) or vocab < 1:
        return None
    device = next((p.device for p in module.parameters() if p.device.type != "meta"), torch.device("cpu"))
    ids = (torch.arange(4, device=device) % vocab).unsqueeze(0)
    return {"input_ids": ids}


@contextlib.contextmanager
def _quiet_forward(module):
    """A forward that changes nothing: no gradient, the random generators restored, the module's mode kept."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        yield


def trace_kinds(module, inputs):
    """``{name: kind}`` of the replicated parameters one forward of ``module`` on ``inputs`` (keyword arguments)
    reaches (module docstring)."""
    flow = ShardFlow(module)
    with _quiet_forward(module), flow:
        module(**inputs)
    return flow.kinds()


def apply_kinds(module, kinds, default=MEAN):
    """Mark every replicated trainable parameter of ``module`` with its kind (``default`` for those not traced)."""
    for name, param in module.named_parameters():
        if not _is_cut(param):
            setattr(param, MARK_ATTR, kinds.get(name, default))


def kind_of(param):
    """``"sum"``, ``"mean"``, or None for a parameter that is cut (or of a model without tensor parallelism)."""
    return getattr(param, MARK_ATTR, None)
