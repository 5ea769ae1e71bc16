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
  sees half a step).

What the hooks cannot see: code that reads a parameter's value outside any forward and not through
``state_dict`` (or a module that reads another module's parameter before that module's forward ran)
between ``engine.step()`` and the next forward. ``DS_OFFLOAD_OVERLAP=0`` turns the overlap off; reading
through ``deepspeed.utils.safe_get_*`` or the engine's checkpoint functions always waits.
"""


class PieceWaits:
    """The hooks of the module docstring, for ``stage`` (a ``PartitionedStage``) and its ``module``."""

    def __init__(self, stage, module):
        layout = stage.layout
        last = len(layout.buckets) - 1
        host_step = stage.host_step
        self.handles = []
        for sub in module.modules():
            indices = [last - layout.slots[p].bucket for p in sub.parameters(recurse=False) if p in layout.slots]
            if not indices:
                continue
            through = max(indices)

            def pre_forward(_module, _args, through=through):
                host_step.wait_for_piece(through)

            def pre_state_dict(*_args, **_kwargs):
                host_step.finish()

            self.handles.append(sub.register_forward_pre_hook(pre_forward))
            self.handles.append(sub.register_state_dict_pre_hook(pre_state_dict))

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []
