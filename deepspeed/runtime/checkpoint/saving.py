# SPDX-License-Identifier: Apache-2.0
"""``save_checkpoint``: what each rank writes, in which order, and how the ranks stay in step.

1. Every rank checks its arguments (``save_dir``, ``tag``, ``client_state``); the ranks
   then agree (one ``all_gather_object``): every rank raises if any rank failed, or if
   the tags differ. Rank 0's random save id goes to all.
2. Every rank creates ``<save_dir>/<tag>`` and writes the files its stage lists
   (``StageCheckpoint.checkpoint_files``): rank 0 ``mp_rank_00_model_states.pt`` (with the
   optimizer state for stage 0), every rank of stages 1/2 its optimizer file, every rank
   of stage 3 its own model-states file (buffers, no parameters) and optimizer file; with tensor
   parallelism each tensor-parallel rank ``t`` writes that set for its data-parallel group, named
   ``mp_rank_{t:02d}`` (``paths``), and the agreements span every rank. Each
   file is written under a temporary name and renamed (``writer``), and carries the save id.
3. The ranks agree again (a barrier that also carries write errors).
4. Rank 0 writes ``latest`` (when ``save_latest``), then a last agreement: when
   ``save_checkpoint`` returns on any rank, the whole checkpoint and ``latest`` are on disk.

With ``"checkpoint": {"save_format": "upstream"}`` step 2 writes into a hidden folder
``<save_dir>/.<tag>.native-<id>``; after the agreement rank 0 writes upstream DeepSpeed's files of
the tag from them (``deepspeed.checkpoint.upstream_writer``; it reads every rank's files, so the
save directory must be shared) and removes the folder; the ranks agree once more.

A crash before step 4 leaves ``latest`` naming the previous checkpoint, whose files were
not touched (unless the save reused its tag: then the loader reports the mix of files of
two saves, thanks to the save id).
"""

import os
import stat
import uuid

import deepspeed.comm as dist
from deepspeed.runtime.checkpoint import expert as expert_checkpoint
from deepspeed.runtime.checkpoint import completeness, model_state, paths
from deepspeed.runtime.checkpoint.optimizer_state import export_scaler
from deepspeed.runtime.checkpoint.stage_checkpoint import SaveContext, checkpoint_of
from deepspeed.runtime.checkpoint.validate import agree, check_dir, check_tag
from deepspeed.runtime.checkpoint.writer import SaveWriter, atomic_copy
from deepspeed.runtime.checkpoint_engine.staging import stage_to_host
from deepspeed.runtime.configuration.tag_validation import resolve_tag
from deepspeed.utils.logging import logger


def check_stage(engine, what):
    """NotImplementedError for stages this checkpoint code does not handle (the same on every rank)."""
    stage = engine.zero_optimization_stage()
    if stage == 3 and engine.optimizer is None:
        raise NotImplementedError(f"{what}: ZeRO stage 3 checkpoints need an optimizer")
    if stage not in (0, 1, 2, 3):
        raise NotImplementedError(f"{what}: unknown ZeRO stage {stage}")
    return stage


def agreement_group(engine):
    """The ranks that agree on a save or load: the data-parallel group, or every rank when the model is cut over
    tensor-parallel ranks (each writes its own files, and ``latest`` must name a tag all of them finished)."""
    return None if engine.mp_world_size > 1 else engine.data_parallel_group


def parallel_ranks(engine):
    """``(data-parallel rank, tensor-parallel rank)`` of this rank: which files it writes and reads."""
    from deepspeed.utils import groups
    if engine.mp_world_size > 1:
        return groups._get_sequence_data_parallel_rank(), groups.get_tensor_model_parallel_rank()
    return engine.global_rank, 0


def _local_checks(engine, save_dir, tag, client_state):
    save_dir = check_dir(save_dir, "save_checkpoint")
    tag = check_tag(paths.default_tag(engine.global_steps) if tag is None else tag, "save_checkpoint")
    client_state = model_state.check_client_state(client_state)
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise ValueError(f"save_checkpoint: {save_dir} exists and is not a directory")
    return save_dir, tag, client_state


def save(engine, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
    """See the module docstring; returns True."""
    check_stage(engine, "save_checkpoint")
    if engine.mp_world_size > 1 and getattr(engine._config, "checkpoint_save_format", "native") == "upstream":
        raise NotImplementedError("checkpoint.save_format 'upstream' with tensor parallelism is not supported; save "
                                  "the native format (upstream's file names per tensor-parallel rank)")
    ckpt_engine = engine.checkpoint_engine
    decoupled = ckpt_engine.is_decoupled()
    group = agreement_group(engine)
    rank = engine.global_rank
    error = None
    if decoupled:  # one save at a time: the previous one is written and committed (its failure raises here)
        ckpt_engine.wait()
    try:
        save_dir, tag, client_state = _local_checks(engine, save_dir, tag, client_state)
    except Exception as exc:
        error = exc
    agreed = agree(error, (str(tag), uuid.uuid4().hex), group)
    tag = resolve_tag([t for t, _ in agreed], dist.get_rank(group=group), engine._config)  # tag_validation decides
    save_id = agreed[0][1]

    upstream = getattr(engine._config, "checkpoint_save_format", "native") == "upstream"
    # upstream's layout: this package's files go to a hidden folder first, from which rank 0 writes upstream's
    native_root = os.path.join(save_dir, f".{tag}.native-{save_id[:12]}") if upstream else save_dir
    commit_group = ckpt_engine.commit_group() if decoupled else group
    writer = SaveWriter(ckpt_engine, defer=decoupled)
    error = None
    try:
        if rank == 0 and not upstream:
            os.makedirs(paths.tag_dir(save_dir, tag), exist_ok=True)
            completeness.remove_mark(save_dir, tag)  # a save into an existing tag: incomplete until committed
        _write_files(engine,
                     writer,
                     native_root,
                     tag,
                     client_state,
                     exclude_frozen_parameters,
                     save_id,
                     rank,
                     complete_mark=not upstream)
    except Exception as exc:
        error = exc
    commit = _Commit(save_dir, tag, save_id, save_latest, upstream, native_root, rank)
    if not decoupled:
        commit(writer, error, group)
        return True
    # decoupled: the ranks agree that staging went well, then the writes and the commit go behind training
    staged = None
    try:
        if error is None:
            paths_, payloads = zip(*writer.deferred) if writer.deferred else ((), ())
            staged = list(zip(paths_, stage_to_host(list(payloads))))
    except Exception as exc:
        error = exc
    agree(error, None, group)
    writer.deferred = None
    import torch.distributed as torch_dist
    ckpt_engine.submit(lambda: commit(writer, None, commit_group, staged, torch_dist))
    return True


class _Commit:
    """The end of a save on one rank: the files written, the ranks agree, rank 0 converts (upstream format), writes
    the completeness mark and ``latest``, the ranks agree again. Runs in ``save_checkpoint`` or on the decoupled
    writer's thread (``staged`` files to write first, ``comm``/``group`` of the writer's own)."""

    def __init__(self, save_dir, tag, save_id, save_latest, upstream, native_root, rank):
        self.save_dir, self.tag, self.save_id, self.save_latest = save_dir, tag, save_id, save_latest
        self.upstream, self.native_root, self.rank = upstream, native_root, rank

    def __call__(self, writer, error, group, staged=None, comm=None):
        if staged is not None:
            try:
                writer.write_deferred(staged)
            except Exception as exc:
                error = exc
            staged.clear()  # the host copies go as soon as they are on disk
        agree(error, None, group, comm)  # every rank's files are durable (each was synced before its rename)
        if self.upstream:
            error = None
            if self.rank == 0:
                try:
                    _write_upstream(self.native_root, self.save_dir, self.tag)
                except Exception as exc:
                    error = exc
            agree(error, None, group, comm)
        error = None
        if self.rank == 0:
            try:
                if not self.upstream:
                    completeness.write_mark(self.save_dir, self.tag, self.save_id)
                if self.save_latest:
                    writer.write_text(self.tag, paths.latest_path(self.save_dir))
                _copy_recovery_script(self.save_dir)
            except Exception as exc:
                error = exc
        agree(error, None, group, comm)


def _write_files(engine,
                 writer,
                 save_dir,
                 tag,
                 client_state,
                 exclude_frozen_parameters,
                 save_id,
                 rank,
                 complete_mark=False):
    """Write the files the engine's stage lists for this rank (see ``stage_checkpoint``)."""
    stage = checkpoint_of(engine)

    def build_model_states(groups, meta, optimizer=None, module=None):
        return model_state.build_model_states(engine,
                                              groups,
                                              exclude_frozen_parameters,
                                              meta,
                                              client_state,
                                              optimizer=optimizer,
                                              module=module)

    dp_rank, mp_rank = parallel_ranks(engine)
    save = SaveContext(
        name_of=model_state.param_names(engine.module),
        save_id=save_id,
        dp_rank=dp_rank,
        mp_rank=mp_rank,
        dp_world_size=engine.seq_dp_world_size,  # the ranks ZeRO partitions span (data x sequence)
        bf16=bool(engine.bfloat16_enabled()),
        fp16=bool(engine.fp16_enabled()),
        exclude_frozen_parameters=exclude_frozen_parameters,
        scaler=export_scaler(engine),
        ds_config=engine.config,
        build_model_states=build_model_states,
        complete_mark=complete_mark)
    directory = paths.tag_dir(save_dir, tag)
    os.makedirs(directory, exist_ok=True)
    for name, payload in stage.checkpoint_files(save):
        writer.save(payload, os.path.join(directory, name))
    expert_checkpoint.write_files(engine, writer, directory)  # experts: upstream's per-expert files


def _write_upstream(native_root, save_dir, tag):
    """Rank 0: upstream's files of the tag from this package's, then the hidden folder is removed."""
    import shutil
    from deepspeed.checkpoint.upstream_writer import convert_to_upstream
    convert_to_upstream(paths.tag_dir(native_root, tag), paths.tag_dir(save_dir, tag))
    shutil.rmtree(native_root, ignore_errors=True)


def _copy_recovery_script(save_dir):
    """Put an executable ``zero_to_fp32.py`` next to the checkpoints, as upstream does (best effort)."""
    destination = os.path.join(save_dir, paths.RECOVERY_SCRIPT)
    try:
        from deepspeed.utils import zero_to_fp32
        atomic_copy(zero_to_fp32.__file__, destination)
    except Exception as exc:  # the checkpoint itself is complete; the helper script is a convenience
        logger.warning(f"could not copy {paths.RECOVERY_SCRIPT} into {save_dir}: {exc}")
        return
    make_executable(destination)


def make_executable(path):
    """Add the owner's execute bit to ``path`` (``./zero_to_fp32.py``). A file system that refuses permissions (an
    Azure file share) or a missing file is logged at info level and otherwise ignored, as upstream."""
    try:
        os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    except (FileNotFoundError, PermissionError) as exc:
        logger.info(f"could not make {path} executable ({exc}); continuing without changing its permissions")
