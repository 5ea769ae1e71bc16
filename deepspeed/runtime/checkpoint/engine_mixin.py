# SPDX-License-Identifier: Apache-2.0
"""The engine's checkpoint methods: ``save_checkpoint``, ``load_checkpoint``, ``save_16bit_model``, and the
ZeRO-3 consolidated 16-bit state dict.

``DeepSpeedEngine`` gets them by inheriting :class:`CheckpointEngineMixin`; :func:`attach`
gives them to an engine class that does not (it copies the methods onto the class).
The work is done in :mod:`saving` and :mod:`loading`; the file layout is in
:mod:`paths`; docs/checkpoints.md describes the whole.
"""

import os

from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.runtime.checkpoint import loading, saving
from deepspeed.runtime.checkpoint.consolidated import consolidated_16bit_state_dict
from deepspeed.runtime.checkpoint.model_state import module_state_dict
from deepspeed.runtime.checkpoint.validate import check_dir
from deepspeed.runtime.checkpoint.writer import atomic_torch_save
from deepspeed.utils.logging import logger


class CheckpointEngineMixin:
    """Checkpoint methods of ``DeepSpeedEngine`` (ZeRO stages 0 to 3)."""

    @property
    def checkpoint_engine(self):
        """The ``CheckpointEngine`` that writes this engine's checkpoint files (``checkpoint.writer`` picks it;
        made on first use)."""
        ckpt_engine = self.__dict__.get("_ds_checkpoint_engine")
        if ckpt_engine is None:
            from deepspeed.runtime.checkpoint_engine import create_checkpoint_engine
            ckpt_engine = create_checkpoint_engine(self._config, None, self.zero_optimization_stage(), False,
                                                   self.zero_optimization_stage() < 3)
            self.__dict__["_ds_checkpoint_engine"] = ckpt_engine
        return ckpt_engine

    @checkpoint_engine.setter
    def checkpoint_engine(self, value):
        self.__dict__["_ds_checkpoint_engine"] = value

    def _close_checkpoint_engine(self):
        """Wait for a checkpoint still being written behind training (its failure is logged) and release the
        writer's resources; ``destroy()`` calls it."""
        ckpt_engine = self.__dict__.pop("_ds_checkpoint_engine", None)
        if ckpt_engine is not None:
            ckpt_engine.cleanup()

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """Collective: save the training state under ``<save_dir>/<tag>`` (default tag ``global_step{N}``).

        ``save_dir`` and ``tag`` are checked on every rank before any collective; a bad or
        differing value raises ValueError on every rank. ``client_state`` (a dict) is stored
        in the model-states file and returned by ``load_checkpoint``. With ``save_latest``,
        ``<save_dir>/latest`` names the tag once every rank's files are on disk. Returns True.

        With ``checkpoint.writer.decoupled`` it returns once the state is staged in host memory; the files, the
        tag's completeness mark and ``latest`` are written behind training (docs/checkpoints.md), and the next
        save waits for them.
        """
        self._states.require("save_checkpoint")  # EngineUsageError while offload_states() holds state
        return saving.save(self,
                           save_dir,
                           tag=tag,
                           client_state=client_state,
                           save_latest=save_latest,
                           exclude_frozen_parameters=exclude_frozen_parameters)

    def _change_recovery_script_permissions(self, dst):
        """Make the copied recovery script ``dst`` executable (upstream's name; failures are logged, not raised)."""
        saving.make_executable(dst)

    def load_checkpoint(self,
                        load_dir,
                        tag=None,
                        load_module_strict=True,
                        load_optimizer_states=True,
                        load_lr_scheduler_states=True,
                        load_module_only=False,
                        custom_load_fn=None):
        """Collective: restore a checkpoint; ``(path of its model-states file, client_state)``.

        ``tag=None`` reads ``<load_dir>/latest``; ``(None, None)`` when there is nothing to
        load (no ``latest``, or an explicit tag whose directory does not exist). A checkpoint
        of any stage loads into any data-parallel world size and any stage; parameters are
        matched by name. ``client_state`` is upstream's: the model-states file's entries the
        load did not consume. A missing, truncated or mismatched file, or a model of another
        shape, raises on every rank with a message naming the file.
        """
        self._states.require("load_checkpoint")
        return loading.load(self,
                            load_dir,
                            tag=tag,
                            load_module_strict=load_module_strict,
                            load_optimizer_states=load_optimizer_states,
                            load_lr_scheduler_states=load_lr_scheduler_states,
                            load_module_only=load_module_only,
                            custom_load_fn=custom_load_fn)

    def module_state_dict(self, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        """The module's state dict (live tensors), optionally without frozen parameters."""
        if destination is not None or prefix or keep_vars:
            state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
            if exclude_frozen_parameters:
                for name, param in self.module.named_parameters(remove_duplicate=False):
                    if not param.requires_grad:
                        state.pop(prefix + name, None)
            return state
        return module_state_dict(self.module, exclude_frozen_parameters)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        """Collective (call it on every rank): the whole 16-bit state dict of a ZeRO-3 model, on rank 0.

        As upstream: an ``OrderedDict`` of CPU tensors on rank 0 (every name of a tied
        parameter, no non-persistent buffers; see ``consolidated.py``), None on the other
        ranks. ValueError on stages 0-2.
        """
        if self.zero_optimization_stage() != 3 or self._stage is None:
            raise ValueError("_zero3_consolidated_16bit_state_dict() needs a ZeRO stage 3 engine")
        return consolidated_16bit_state_dict(self.module, self._stage.checkpoint(), exclude_frozen_parameters)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        """Collective (every rank): the whole, unsharded state dict of the model on rank 0, None elsewhere.

        A tensor-parallel model's cut parameters are gathered over their group and reassembled (and, with ZeRO-3,
        over their data-parallel group first); otherwise as ``_zero3_consolidated_16bit_state_dict`` (stage 3) or the
        module's state dict (stages 0-2). What Accelerate's ``get_state_dict`` calls with ``autotp_size`` > 1.
        """
        from deepspeed.runtime.tensor_parallel.checkpoint import consolidated_state_dict
        if self.mp_world_size > 1:
            return consolidated_state_dict(self, exclude_frozen_parameters)
        if self.zero_optimization_stage() == 3:
            return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        state = module_state_dict(self.module, exclude_frozen_parameters) if self.global_rank == 0 else None
        return clone_tensors_for_torch_save(state)

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False):
        """Rank 0 writes the module's state dict (in the model's dtype) to ``<save_dir>/<save_filename>``.

        Stages 0-2: not collective (as upstream); other ranks only check their arguments.
        Stage 3: collective (the parameters are gathered); returns False without writing
        when ``stage3_gather_16bit_weights_on_model_save`` is off. Tensor parallelism: collective,
        the unsharded model. Otherwise returns True.
        """
        save_dir = check_dir(save_dir, "save_16bit_model")
        if not save_filename or not str(save_filename).strip():
            raise ValueError("save_16bit_model: save_filename is empty")
        path = os.path.join(save_dir, str(save_filename))
        if self.zero_optimization_stage() == 3 and not self.zero_gather_16bit_weights_on_model_save():
            logger.warning(f"save_16bit_model: did not save {path}: with ZeRO stage 3 it needs "
                           f"zero_optimization.stage3_gather_16bit_weights_on_model_save=true")
            return False
        if self.mp_world_size > 1:  # tensor parallelism: the unsharded model (a collective)
            state = self._consolidated_16bit_state_dict(exclude_frozen_parameters)
        elif self.zero_optimization_stage() == 3:
            # fresh CPU tensors already, tied names bound to one tensor (saved once, as upstream)
            state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        else:
            saving.check_stage(self, "save_16bit_model")
            state = module_state_dict(self.module, exclude_frozen_parameters) if self.global_rank == 0 else None
            state = clone_tensors_for_torch_save(state)
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            atomic_torch_save(state, path)
        return True


def attach(engine_cls):
    """Give ``engine_cls`` the methods of :class:`CheckpointEngineMixin` (no-op if it already inherits it).

    For an engine class whose definition does not list the mixin; the methods are set
    on the class, so every instance, existing or new, has them. Returns ``engine_cls``.
    """
    if issubclass(engine_cls, CheckpointEngineMixin):
        return engine_cls
    for name, value in vars(CheckpointEngineMixin).items():
        if not name.startswith("__"):
            setattr(engine_cls, name, value)
    return engine_cls
