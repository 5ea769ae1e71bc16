# SPDX-License-Identifier: Apache-2.0
"""ZeRO stage 0's checkpoint export and import (the interface of ``runtime/checkpoint/stage_checkpoint.py``).

Stage 0 keeps everything replicated, so rank 0 writes the whole training state into the
model-states file's ``optimizer`` entry and no rank writes an optimizer file. The entry
holds ``zero_stage`` 0, ``optimizer`` (the torch optimizer's ``state_dict()``, over the
fp32 masters of a 16-bit model or the model's own fp32 parameters), ``param_names`` (the
name of every parameter of every param group, in ``state_dict`` index order),
``fp32_master_weights`` (name -> fp32 master; None for fp32 models, whose parameters are
the masters) and the loss-scaler entries. ``engine.optimizer.load_state_dict`` accepts it.

Import: every source is a ``FullState`` (a stage-0 checkpoint gives one directly, any
other stage through resharding); each parameter's fp32 value goes to its master (or the
parameter itself) and the per-parameter optimizer state is rebuilt by name.
"""

import torch

from deepspeed.runtime.checkpoint import paths
from deepspeed.runtime.checkpoint.optimizer_state import check_full_state, group_entry, load_inner
from deepspeed.runtime.checkpoint.reshard import FullState
from deepspeed.runtime.checkpoint.stage_checkpoint import StageCheckpoint
from deepspeed.runtime.checkpoint.validate import CheckpointError


class Stage0Checkpoint(StageCheckpoint):
    """Checkpoint export and import of a :class:`~deepspeed.runtime.zero.stage0.Stage0`."""

    optimizer_in_model_states = True

    def __init__(self, stage):
        self.stage = stage
        self.inner = stage.optimizer
        masters = stage.masters
        # inner optimizer parameter (an fp32 master, or the model parameter itself) -> model parameter
        self._model_of = {} if masters is None else dict(zip(masters.masters, masters.model_params))

    def _model(self, param):
        return self._model_of.get(param, param)

    def param_groups(self):
        return [[self._model(p) for p in group["params"] if self._model(p).requires_grad]
                for group in self.inner.param_groups]

    # ---------------------------------------------------------------- export
    def _optimizer_entry(self, save):
        names = [[save.name_of.get(self._model(p)) for p in group["params"]] for group in self.inner.param_groups]
        masters = self.stage.masters
        fp32 = None
        if masters is not None:
            fp32 = {save.name_of[p]: m.detach() for p, m in zip(masters.model_params, masters.masters)}
        entry = dict(zero_stage=0, optimizer=self.inner.state_dict(), param_names=names, fp32_master_weights=fp32)
        entry.update(save.scaler)
        return entry

    def checkpoint_files(self, save):
        if save.dp_rank != 0:
            return []
        states = save.model_states(self.param_groups(),
                                   save.meta(0, optim_files=[]),
                                   optimizer=self._optimizer_entry(save))
        return [(paths.model_states_name(save.mp_rank), states)]

    # ---------------------------------------------------------------- import
    def prepare_import(self, source, load_optimizer_states, name_of, describe):
        if not isinstance(source, FullState):
            raise CheckpointError(f"{describe}: ZeRO stage 0 loads a checkpoint by parameter name only")
        full = source
        check_full_state(full, self.param_groups(), name_of, self.inner, load_optimizer_states, describe)
        stage = self.stage
        inner = self.inner
        sd = None
        if load_optimizer_states:
            sd = {"state": {}, "param_groups": []}
            index = 0
            for g, group in enumerate(inner.param_groups):
                ids = []
                for q in group["params"]:
                    st = full.state.get(name_of.get(self._model(q)))
                    if st:
                        sd["state"][index] = st
                    ids.append(index)
                    index += 1
                sd["param_groups"].append(group_entry(full, g, ids))
        params = list(stage.params)

        @torch.no_grad()
        def apply():
            for param in params:
                target = stage.masters.master_of(param) if stage.masters is not None else param
                target.copy_(full.fp32[name_of[param]])
            if stage.masters is not None:
                stage.masters.copy_to_model()
            if sd is not None:
                load_inner(inner, sd)

        return apply

    def refresh_from_model(self):
        if self.stage.masters is not None:
            self.stage.masters.copy_from_model()
