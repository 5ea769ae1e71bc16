# SPDX-License-Identifier: Apache-2.0
"""``unwrap_model_for_generation(engine)``: gather a ZeRO-3 model once for a run of forwards (``generate()``).

Inside ``with unwrap_model_for_generation(engine) as model:`` every parameter of the engine's model is whole
(one gather for all of them, released on exit), and the module hooks that gather and release units are removed
(installed again on exit; ``engine.optimizer.forward_hooks`` is empty inside, as upstream's), so a generation
loop of many small forwards runs without them. The engine itself is yielded, as upstream does; its module and any
submodule can be called directly. Training steps inside the context are not supported. On stages 0-2 the
parameters are whole anyway and the context only yields the engine.
"""

import contextlib

from deepspeed.runtime.zero.partition_parameters import GatheredParameters


@contextlib.contextmanager
def unwrap_model_for_generation(model):
    """See the module docstring (a collective on ZeRO-3: call it on every rank)."""
    coordinator = getattr(getattr(model, "_stage", None), "coordinator", None)
    if coordinator is not None:  # an engine's ZeRO-3 units: hold each gathered for the whole context
        coordinator.hold_all()
        coordinator.remove_hooks()
        try:
            yield model
        finally:
            coordinator.reinstall_hooks()
            coordinator.drop_all_holds()
        return
    module = getattr(model, "module", model)
    with GatheredParameters(list(module.parameters())):  # a model built in zero.Init, not yet in an engine
        yield model
