# SPDX-License-Identifier: Apache-2.0
"""Consolidate a ZeRO 0/1/2/3 checkpoint into one fp32 state dict, without torch.distributed.

::

    python -m deepspeed.utils.zero_to_fp32 <checkpoint_dir> <output> [-t TAG]
    python zero_to_fp32.py . pytorch_model.bin          # the copy save_checkpoint leaves in checkpoint_dir

``checkpoint_dir`` is the directory that holds ``latest`` and the tag directories.
The fp32 value of each trainable parameter is the optimizer's fp32 master (rebuilt
from every rank's partition for stages 1 and 2, with the layout recorded in the
files); frozen parameters and buffers are taken from the saved module, in their
saved dtype. A stage-3 checkpoint keeps only buffers in its (per-rank) model-states
files: every parameter is rebuilt from every rank's shards (trainable: the fp32
masters; frozen: the saved 16-bit shards). The result has the keys and order of the model's ``state_dict()``,
tied parameters included (sharing one tensor). A checkpoint written by upstream DeepSpeed
(stages 0-3) is read with its own layout (``deepspeed.checkpoint.upstream_format``).

The output is a file (a path with a ``.bin/.pt/.pth/.ckpt/.safetensors`` suffix, or an
existing file) or a directory, where ``pytorch_model.bin`` (``model.safetensors``) is
written, split into shards of at most ``max_shard_size`` with an index (the Hugging Face
layout) when larger.
"""

import argparse
import json
import os
import re
import sys
from collections import OrderedDict

from deepspeed.runtime.checkpoint import paths
from deepspeed.runtime.checkpoint.reader import META_KEY, check_save_id, load_file
from deepspeed.runtime.checkpoint.reshard import full_state_from_partitions
from deepspeed.runtime.checkpoint.stage3_state import full_state_from_zero3
from deepspeed.runtime.checkpoint.validate import CheckpointError
from deepspeed.runtime.checkpoint.writer import atomic_torch_save, atomic_write_text

_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".safetensors")
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40
}


# ------------------------------------------------------------ the files
def _natural_key(text):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def get_checkpoint_files(checkpoint_dir, glob_pattern):
    """Files of a tag directory matching ``glob_pattern``, in natural order; FileNotFoundError if none."""
    import glob
    files = sorted(glob.glob(os.path.join(checkpoint_dir, glob_pattern)), key=_natural_key)
    if not files:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return files


def get_optim_files(checkpoint_dir):
    """The ``*_optim_states.pt`` files of a tag directory (ZeRO 1/2), rank order."""
    return get_checkpoint_files(checkpoint_dir, "*" + paths.OPTIM_STATES_SUFFIX)


def get_model_state_files(checkpoint_dir):
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def get_model_state_file(checkpoint_dir, zero_stage):
    """The model-states file of a tag directory (``mp_rank_00_model_states.pt`` for stages 0-2)."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    if int(zero_stage) <= 2:
        path = os.path.join(checkpoint_dir, paths.MODEL_STATES_FILE)
    else:
        path = os.path.join(checkpoint_dir, paths.ZERO3_MODEL_STATES_FILE.format(rank=0))
    if not os.path.exists(path):
        raise FileNotFoundError(f"can't find model states file at '{path}'")
    return path


def _tag_dir(checkpoint_dir, tag):
    if tag is None:
        tag = paths.read_latest(checkpoint_dir)
        if tag is None:
            raise ValueError(f"Unable to find 'latest' file at {paths.latest_path(checkpoint_dir)}; pass the tag")
    directory = paths.tag_dir(checkpoint_dir, tag)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"Directory '{directory}' doesn't exist")
    return directory


# ------------------------------------------------------- the state dict
def _trainable_fp32(ds_dir, checkpoint, model_path):
    """name -> fp32 value of every trainable parameter."""
    meta = checkpoint.get(META_KEY) or {}
    module = checkpoint["module"]
    names = [name for group in checkpoint.get("param_shapes") or [] for name in group]
    stage = meta.get("zero_stage", 0)
    if stage in (1, 2) and meta.get("has_optimizer", True):
        files = [os.path.join(ds_dir, name) for name in meta.get("optim_files") or []]
        if not files:
            raise CheckpointError(f"{model_path}: a ZeRO stage {stage} checkpoint that lists no optimizer files")
        payloads = []
        for rank, path in enumerate(files):
            payload = load_file(path, f"the optimizer partition of rank {rank}", mmap=True)
            check_save_id(payload, path, meta.get("save_id"))
            payloads.append(payload["optimizer_state_dict"])
        return full_state_from_partitions(payloads, files, with_state=False).fp32
    if stage not in (0, 1, 2):
        raise NotImplementedError(f"{model_path}: ZeRO stage {stage} checkpoints are not supported")
    optimizer = checkpoint.get("optimizer")
    masters = optimizer.get("fp32_master_weights") if isinstance(optimizer, dict) else None
    fp32 = {}
    for name in names:
        value = masters.get(name) if masters is not None else module.get(name)
        if value is None:
            raise CheckpointError(f"{model_path}: no value for trainable parameter '{name}'")
        fp32[name] = value.float()
    return fp32


def _zero3_state_dict(ds_dir, model_path, exclude_frozen_parameters):
    """The state dict of a stage-3 checkpoint (module docstring)."""
    checkpoint = load_file(model_path, "the model states")
    meta = checkpoint.get(META_KEY) or {}
    files = [os.path.join(ds_dir, name) for name in meta.get("optim_files") or []]
    if meta.get("zero_stage") != 3 or not files:
        raise CheckpointError(f"{model_path}: not a ZeRO stage 3 model-states file of this runtime")
    payloads = []
    for rank, path in enumerate(files):
        payload = load_file(path, f"the optimizer partition of rank {rank}", mmap=True)
        check_save_id(payload, path, meta.get("save_id"))
        payloads.append(payload["optimizer_state_dict"])
    full, frozen = full_state_from_zero3(payloads, files, with_state=False)
    values = dict(full.fp32)
    if not exclude_frozen_parameters:
        values.update(frozen)
    shared = checkpoint.get("shared_params") or {}
    buffers = checkpoint["module"]
    result = OrderedDict()
    for name in meta.get("state_dict_keys") or list(values) + list(buffers):
        target = shared.get(name, name)
        if target in values:
            result[name] = values[target]
        elif name in buffers:
            result[name] = buffers[name]
    for name, value in values.items():
        result.setdefault(name, value)
    return result


def _upstream_state_dict(ds_dir, checkpoint, model_path, exclude_frozen_parameters):
    """The state dict of a checkpoint written by upstream DeepSpeed (any stage), in its module's key order."""
    from deepspeed.checkpoint.upstream_format import UpstreamCheckpoint
    reader = UpstreamCheckpoint(ds_dir, checkpoint, model_path)
    full, frozen, _ = reader.full_state(with_state=False)
    buffers = set(checkpoint.get("buffer_names") or [])
    shared = checkpoint.get("shared_params") or {}
    module = checkpoint["module"]
    result = OrderedDict()
    for name, tensor in module.items():
        target = shared.get(name, name)
        if target in full.fp32:
            result[name] = full.fp32[target]
        elif name in buffers:
            result[name] = tensor
        elif not exclude_frozen_parameters:
            value = frozen.get(target, tensor)
            if value.numel() or not reader.per_rank:
                result[name] = value
    for name, value in full.fp32.items():
        result.setdefault(name, value)
    return result


def _tensor_parallel_state_dict(ds_dir, exclude_frozen_parameters):
    """A checkpoint saved with tensor parallelism: every tensor-parallel rank's files merged into whole tensors."""
    from deepspeed.runtime.tensor_parallel.checkpoint import merged_full_state
    root, tag = os.path.split(os.path.abspath(ds_dir))
    model_states, full, frozen, _, _ = merged_full_state(root, tag)
    shared = model_states.get("shared_params") or {}
    frozen_names = set(model_states.get("frozen_param_shapes") or {})
    result = OrderedDict()
    for name, tensor in model_states["module"].items():
        target = shared.get(name, name)
        if target in full.fp32:
            result[name] = full.fp32[target]
        elif target in frozen_names:
            if not exclude_frozen_parameters:
                result[name] = frozen.get(target, tensor)
        else:
            result[name] = tensor  # a buffer
    for name, value in full.fp32.items():
        result.setdefault(name, value)
    return result


def _fp32_state_dict(ds_dir, exclude_frozen_parameters):
    from deepspeed.checkpoint.upstream_format import is_upstream_model_states
    model_path = os.path.join(ds_dir, paths.MODEL_STATES_FILE)
    zero3_path = os.path.join(ds_dir, paths.ZERO3_MODEL_STATES_FILE.format(rank=0))
    if not os.path.exists(model_path) and os.path.exists(zero3_path):
        checkpoint = load_file(zero3_path, "the model states")
        if int(checkpoint.get("tensor_parallel_size") or 1) > 1:
            return _tensor_parallel_state_dict(ds_dir, exclude_frozen_parameters)
        if is_upstream_model_states(checkpoint):
            return _upstream_state_dict(ds_dir, checkpoint, zero3_path, exclude_frozen_parameters)
        return _zero3_state_dict(ds_dir, zero3_path, exclude_frozen_parameters)
    checkpoint = load_file(model_path, "the model states")
    if int(checkpoint.get("tensor_parallel_size") or 1) > 1:
        return _tensor_parallel_state_dict(ds_dir, exclude_frozen_parameters)
    if is_upstream_model_states(checkpoint):
        return _upstream_state_dict(ds_dir, checkpoint, model_path, exclude_frozen_parameters)
    fp32 = _trainable_fp32(ds_dir, checkpoint, model_path)
    frozen = set(checkpoint.get("frozen_param_shapes") or {})
    shared = checkpoint.get("shared_params") or {}
    result = OrderedDict()
    for name, tensor in checkpoint["module"].items():
        target = shared.get(name, name)
        if target in fp32:
            result[name] = fp32[target]
        elif target in frozen:
            if not exclude_frozen_parameters:
                result[name] = tensor
        else:
            result[name] = tensor  # a buffer
    for name, value in fp32.items():
        result.setdefault(name, value)
    return result


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir,
                                             tag=None,
                                             exclude_frozen_parameters=False,
                                             lazy_mode=False):
    """The consolidated fp32 state dict of ``<checkpoint_dir>/<tag>`` (``tag=None``: the one ``latest`` names).

    ``lazy_mode`` is accepted for compatibility; the tensors are always materialized.
    """
    return _fp32_state_dict(_tag_dir(checkpoint_dir, tag), exclude_frozen_parameters)


# ------------------------------------------------------------- writing
def _parse_size(size):
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"max_shard_size: cannot read {size!r}; use bytes or a size such as '5GB' or '500MB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _shards(state_dict, limit):
    """Lists of names, each list at most ``limit`` bytes (one larger tensor alone); tied names stay together."""
    shards, sizes, home = [[]], [0], {}
    for name, tensor in state_dict.items():
        key = id(tensor)
        if key in home:
            shards[home[key]].append(name)
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and sizes[-1] + nbytes > limit:
            shards.append([])
            sizes.append(0)
        shards[-1].append(name)
        sizes[-1] += nbytes
        home[key] = len(shards) - 1
    return shards


def _save(state, path, safe_serialization):
    if safe_serialization:
        try:
            from safetensors.torch import save_file
        except ImportError as exc:
            raise ImportError("safe_serialization=True needs the safetensors package") from exc
        save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})
    else:
        atomic_torch_save(state, path)


def _is_file_target(output):
    if os.path.isdir(output):
        return False
    return os.path.isfile(output) or os.path.splitext(output)[1].lower() in _FILE_SUFFIXES


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir,
                                               output_dir,
                                               max_shard_size="5GB",
                                               safe_serialization=False,
                                               tag=None,
                                               exclude_frozen_parameters=False):
    """Write the consolidated fp32 state dict to ``output_dir`` (a directory, or a file path; module docstring)."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    output_dir = os.fspath(output_dir)
    if _is_file_target(output_dir):
        parent = os.path.dirname(output_dir)
        if parent:
            os.makedirs(parent, exist_ok=True)
        _save(state_dict, output_dir, safe_serialization or output_dir.endswith(".safetensors"))
        return
    os.makedirs(output_dir, exist_ok=True)
    stem, ext = ("model", ".safetensors") if safe_serialization else ("pytorch_model", ".bin")
    shards = _shards(state_dict, _parse_size(max_shard_size))
    if len(shards) == 1:
        _save(state_dict, os.path.join(output_dir, stem + ext), safe_serialization)
        return
    weight_map = {}
    total = 0
    counted = set()
    for i, names in enumerate(shards):
        filename = f"{stem}-{i + 1:05d}-of-{len(shards):05d}{ext}"
        shard = OrderedDict((name, state_dict[name]) for name in names)
        _save(shard, os.path.join(output_dir, filename), safe_serialization)
        for name, tensor in shard.items():
            weight_map[name] = filename
            if id(tensor) not in counted:
                counted.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write_text(
        json.dumps(index, indent=2, sort_keys=True) + "\n", os.path.join(output_dir, f"{stem}{ext}.index.json"))


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Load the consolidated fp32 weights into ``model`` (moved to the CPU) and return it.

    The model is then an ordinary torch module; wrap it in a new engine to train it with
    DeepSpeed again.
    """
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description="Consolidate a ZeRO checkpoint into one fp32 state dict")
    parser.add_argument("checkpoint_dir", help="directory holding 'latest' and the tag directories")
    parser.add_argument("output_dir", help="output file (e.g. path/pytorch_model.bin) or directory")
    parser.add_argument("-t", "--tag", default=None, help="tag to convert (default: the one 'latest' names)")
    parser.add_argument("--max_shard_size", default="5GB", help="largest shard when writing a directory")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors files")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted for compatibility")
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir,
                                               args.output_dir,
                                               max_shard_size=args.max_shard_size,
                                               safe_serialization=args.safe_serialization,
                                               tag=args.tag,
                                               exclude_frozen_parameters=args.exclude_frozen_parameters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
