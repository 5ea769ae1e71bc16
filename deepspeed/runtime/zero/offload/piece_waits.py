# SPDX-License-Identifier: Apache-2.0
"""Module hooks that let the next forward start while an offloaded step still steps its last buckets.

A pipelined offloaded step (ZeRO 1-2 on one rank, ``offload_step.HostStep.step_and_gather`` with
``background``) returns from ``engine.step()`` before the host has stepped every bucket. Each module
that holds trainable parameters gets

* a forward pre-hook that waits for the pieces holding its parameters (the host until they are stepped
  and their copies issued, the compute stream for the copies): piece ``i`` is bucket ``B - 1 - i``, the
  buckets being laid out in reverse registration order, so the first layers' pieces come first and a
  layer waits only for its own upload;
* a ``state_dict`` pre-hook that completes the whole step (a checkpoint or a copy of the weights never
  sees half a step);
* its ``_parameters`` dict replaced by a :class:`WaitingParameters`, which waits for the same pieces before
  it hands out a parameter: every read of a parameter through its module (``module.weight``,
  ``parameters()``, ``named_parameters()``, a copy or pickle of the module) sees the stepped value, so code
  that reads parameters between ``engine.step()`` and the next forward (an EMA, a log of weight norms, a
  module that reads a sibling's weight) gets what the whole-partition step would have given it.

What this cannot see: a reference to a parameter taken before ``engine.step()`` and read after it without
going through the module again (a list of the parameters kept from an earlier step, the optimizer's
``param_groups``). ``DS_OFFLOAD_OVERLAP=0`` turns the overlap off; reading through
``deepspeed.utils.safe_get_*`` or the engine's checkpoint functions always waits.
"""


class WaitingParameters(dict):
    """A module's ``_parameters`` while its parameters may be waiting for an offloaded step's pieces: handing
    out a parameter (``[name]``, ``get``, ``items``, ``values``) first calls ``wait`` (which returns at once
    when no step is pending). A copy or a pickle of it is a plain dict of the (waited for) parameters."""

    __slots__ = ("wait", )

    def __init__(self, items, wait):
        super().__init__(items)
        self.wait = wait

    def __getitem__(self, key):
        self.wait()
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        self.wait()
        return dict.get(self, key, default)

    def items(self):
        self.wait()
        return dict.items(self)

    def values(self):
        self.wait()
        return dict.values(self)

    def __reduce_ex__(self, protocol):
        self.wait()
        return (dict, (dict(self), ))


class PieceWaits:
    """The hooks of the module docstring, for ``stage`` (a ``PartitionedStage``) and its ``module``."""

    def __init__(self, stage, module):
        layout = stage.layout
        last = len(layout.buckets) - 1
        host_step = stage.host_step
        self.handles = []
        self.modules = []
        for sub in module.modules():
            indices = [last - layout.slots[p].bucket for p in sub.parameters(recurse=False) if p in layout.slots]
            if not indices:
                continue
            through = max(indices)

            def wait(through=through):
                host_step.wait_for_piece(through)

            def pre_forward(_module, _args, wait=wait):
                wait()

            def pre_state_dict(*_args, **_kwargs):
                host_step.finish()

            self.handles.append(sub.register_forward_pre_hook(pre_forward))
            self.handles.append(sub.register_state_dict_pre_hook(pre_state_dict))
            sub._parameters = WaitingParameters(sub._parameters, wait)
            self.modules.append(sub)

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for sub in self.modules:  # back to a plain dict (the step is complete: the stage finished it)
            if isinstance(sub._parameters, WaitingParameters):
                sub._parameters = dict(dict.items(sub._parameters))
        self.modules = []
