# SPDX-License-Identifier: Apache-2.0
"""After ``engine.destroy()``: every method of the engine and of its optimizer raises a clear error.

``destroy()`` removes the hooks and ownership marks the engine put on the model and frees the
stage's buffers. An engine used after that would run forward without gathering ZeRO-3 parameters
(silently, on empty shards) or fail later on a freed buffer. :func:`retire` turns every later call
into an :class:`EngineDestroyedError` that names ``destroy()``.

How: the object's class is swapped for a subclass (made once per class) whose public methods -- those
the engine's own classes define, not ``torch.nn.Module``'s -- raise. Nothing is checked on the hot
path of a live engine, ``isinstance`` still holds, the user's model stays usable as ``engine.module``,
and ``destroy()`` on a destroyed engine does nothing.
"""

_RETIRED_CLASSES = {}

# Methods frameworks call although their names start with an underscore.
_ALSO_GUARDED = ("_zero3_consolidated_16bit_state_dict", )


class EngineDestroyedError(RuntimeError):
    """A DeepSpeed engine (or its optimizer) was used after ``engine.destroy()``."""


def retire(engine):
    """Make ``engine`` and the optimizer it returned unusable (see the module docstring). Idempotent."""
    optimizer = getattr(engine, "optimizer", None)
    _swap(engine, "engine")
    if optimizer is not None:
        _swap(optimizer, "engine.optimizer")


def _swap(obj, label):
    cls = type(obj)
    if getattr(cls, "_ds_retired", False):
        return
    retired = _RETIRED_CLASSES.get(cls)
    if retired is None:
        retired = _RETIRED_CLASSES[cls] = _retired_class(cls, label)
    obj.__class__ = retired


def _guarded_names(cls):
    names = set(_ALSO_GUARDED)
    for klass in cls.__mro__:
        if not klass.__module__.startswith("deepspeed."):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") and name not in _ALSO_GUARDED:
                continue
            if callable(value) or isinstance(value, (staticmethod, classmethod)):
                names.add(name)
    names.discard("destroy")
    return {name for name in names if hasattr(cls, name)}


def _retired_class(cls, label):

    def refuse(name):

        def method(self, *args, **kwargs):
            raise EngineDestroyedError(f"{label}.{name}() was called after engine.destroy(): a destroyed engine "
                                       f"has released its hooks and buffers and cannot be used. Call "
                                       f"deepspeed.initialize() again to get a new engine.")

        method.__name__ = name
        return method

    namespace = {name: refuse(name) for name in _guarded_names(cls)}
    namespace.update(_ds_retired=True, destroy=lambda self: None, __module__=cls.__module__)
    retired = type(cls.__name__, (cls, ), namespace)
    retired.__qualname__ = cls.__qualname__
    return retired
