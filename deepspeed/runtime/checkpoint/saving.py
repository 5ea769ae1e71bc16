# SPDX-License-Identifier: Apache-2.0
"""``save_checkpoint``: what each rank writes, in which order, and how the ranks stay in step.

1. Every rank checks its arguments (``save_dir``, ``tag``, ``client_state``); the ranks
   then agree (one ``all_gather_object``): every rank raises if any rank failed, or if
   the tags differ. Rank 0's random save id goes to all.
2. Every rank creates ``<save_dir>/<tag>``; rank 0 writes ``mp_rank_00_model_states.pt``
   (with the optimizer state for stage 0); for stages 1/2 every rank writes its own
   optimizer file; for stage 3 every rank writes its own model-states file (buffers, no
   parameters) and its own optimizer file (``stage3_state``). Each file is written
   under a temporary name and renamed (``writer``), and carries the save id.
3. The ranks agree again (a barrier that also carries write errors).
4. Rank 0 writes ``latest`` (when ``save_latest``), then a last agreement: when
   ``save_checkpoint`` returns on any rank, the whole checkpoint and ``latest`` are on disk.

A crash before step 4 leaves ``latest`` naming the previous checkpoint, whose files were
not touched (unless the save reused its tag: then the loader reports the mix of files of
two saves, thanks to the save id).
"""

import os
import uuid
from collections import OrderedDict

import torch

from deepspeed.runtime.checkpoint import paths
from deepspeed.runtime.checkpoint.model_state import buffer_names, build_model_states, check_client_state, param_names
from deepspeed.runtime.checkpoint.stage3_state import export_zero3
from deepspeed.runtime.checkpoint.stage_state import export_partitioned, export_stage0, trainable_groups
from deepspeed.runtime.checkpoint.validate import agree, check_dir, check_tag, require_same
from deepspeed.runtime.checkpoint.writer import SaveWriter, atomic_copy
from deepspeed.utils.logging import logger


def check_stage(engine, what):
    """NotImplementedError for stages this checkpoint code does not handle (the same on every rank)."""
    stage = engine.zero_optimization_stage()
    if stage == 3 and engine._stage is None:
        raise NotImplementedError(f"{what}: ZeRO stage 3 checkpoints need an optimizer")
    if stage not in (0, 1, 2, 3):
        raise NotImplementedError(f"{what}: unknown ZeRO stage {stage}")
    return stage


def _local_checks(engine, save_dir, tag, client_state):
    save_dir = check_dir(save_dir, "save_checkpoint")
    tag = check_tag(paths.default_tag(engine.global_steps) if tag is None else tag, "save_checkpoint")
    client_state = check_client_state(client_state)
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise ValueError(f"save_checkpoint: {save_dir} exists and is not a directory")
    return save_dir, tag, client_state


def save(engine, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
    """See the module docstring; returns True."""
    check_stage(engine, "save_checkpoint")
    group = engine.data_parallel_group
    rank = engine.global_rank
    error = None
    try:
        save_dir, tag, client_state = _local_checks(engine, save_dir, tag, client_state)
    except Exception as exc:
        error = exc
    agreed = agree(error, (str(tag), uuid.uuid4().hex), group)
    tag = require_same([t for t, _ in agreed], "save_checkpoint: the checkpoint tag")
    save_id = agreed[0][1]

    writer = SaveWriter()
    error = None
    try:
        _write_files(engine, writer, save_dir, tag, client_state, exclude_frozen_parameters, save_id, rank)
    except Exception as exc:
        error = exc
    agree(error, None, group)

    error = None
    if rank == 0:
        try:
            if save_latest:
                writer.write_text(tag, paths.latest_path(save_dir))
            _copy_recovery_script(save_dir)
        except Exception as exc:
            error = exc
    agree(error, None, group)
    return True


def _write_files(engine, writer, save_dir, tag, client_state, exclude_frozen_parameters, save_id, rank):
    stage = engine.zero_optimization_stage()
    has_optimizer = engine._stage is not None
    name_of = param_names(engine.module)
    bf16 = bool(engine.bfloat16_enabled())
    os.makedirs(paths.tag_dir(save_dir, tag), exist_ok=True)
    if stage == 3:
        _write_zero3_files(engine, writer, save_dir, tag, client_state, exclude_frozen_parameters, save_id, name_of)
        return
    if rank == 0:
        meta = dict(save_id=save_id,
                    zero_stage=stage,
                    has_optimizer=has_optimizer,
                    bf16=bf16,
                    fp16=bool(engine.fp16_enabled()),
                    optim_files=[paths.optim_states_name(r, bf16)
                                 for r in range(engine.dp_world_size)] if has_optimizer and stage > 0 else [])
        optimizer_state = export_stage0(engine, name_of) if has_optimizer and stage == 0 else None
        groups = trainable_groups(engine) if has_optimizer else [[
            p for p in engine.module.parameters() if p.requires_grad
        ]]
        states = build_model_states(engine, groups, exclude_frozen_parameters, optimizer_state, meta, client_state)
        writer.save(states, paths.model_states_path(save_dir, tag))
    if has_optimizer and stage in (1, 2):
        dp_rank = engine._stage.layout.rank
        writer.save(export_partitioned(engine, name_of, save_id),
                    paths.optim_states_path(save_dir, tag, dp_rank, bf16))


def _write_zero3_files(engine, writer, save_dir, tag, client_state, exclude_frozen_parameters, save_id, name_of):
    """Stage 3: every rank writes its model-states file (no parameters) and its optimizer file."""
    bf16 = bool(engine.bfloat16_enabled())
    world = engine.dp_world_size
    dp_rank = engine._stage.layout.rank
    meta = dict(save_id=save_id,
                zero_stage=3,
                has_optimizer=True,
                bf16=bf16,
                fp16=bool(engine.fp16_enabled()),
                optim_files=[paths.optim_states_name(r, bf16) for r in range(world)],
                model_files=[paths.ZERO3_MODEL_STATES_FILE.format(rank=r) for r in range(world)],
                state_dict_keys=list(engine.module.state_dict().keys()))
    states = build_model_states(engine, trainable_groups(engine), exclude_frozen_parameters, None, meta, client_state)
    # stage-3 parameters hold no data outside a gather: shapes are the full ones (``ds_shape``)
    states["param_shapes"] = [
        OrderedDict((name_of[p], torch.Size(p.ds_shape)) for p in group) for group in trainable_groups(engine)
    ]
    states["frozen_param_shapes"] = OrderedDict(
        (name, torch.Size(p.ds_shape)) for name, p in engine.module.named_parameters() if not p.requires_grad)
    persistent = set(buffer_names(engine.module))
    states["module"] = {
        name: buf.detach().cpu().clone()
        for name, buf in engine.module.named_buffers() if name in persistent
    }
    writer.save(states, paths.zero3_model_states_path(save_dir, tag, dp_rank))
    writer.save(export_zero3(engine, name_of, save_id, exclude_frozen_parameters),
                paths.optim_states_path(save_dir, tag, dp_rank, bf16))


def _copy_recovery_script(save_dir):
    """Put ``zero_to_fp32.py`` next to the checkpoints, as upstream does (best effort)."""
    try:
        from deepspeed.utils import zero_to_fp32
        atomic_copy(zero_to_fp32.__file__, os.path.join(save_dir, paths.RECOVERY_SCRIPT))
    except Exception as exc:  # the checkpoint itself is complete; the helper script is a convenience
        logger.warning(f"could not copy {paths.RECOVERY_SCRIPT} into {save_dir}: {exc}")
