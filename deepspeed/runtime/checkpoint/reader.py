# SPDX-License-Identifier: Apache-2.0
"""Reading checkpoint files, with errors that name the file and say what is wrong.

Used by the engine (on every rank, before the ranks agree) and by
``deepspeed.utils.zero_to_fp32`` (without torch.distributed).
"""

import os

import torch

from deepspeed.runtime.checkpoint import paths
from deepspeed.runtime.checkpoint.validate import CheckpointError, check_tag

# Key of the model-states file that records how the checkpoint was written (not client state).
META_KEY = "ds_checkpoint_meta"


def load_file(path, what, mmap=False):
    """``torch.load(path)`` on the CPU; CheckpointError naming ``path`` when missing, truncated or unreadable."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing ({what} of this checkpoint)")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: not a regular file ({what})")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"{path}: empty file, truncated while it was written ({what})")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as exc:  # torch reports truncation as RuntimeError/EOFError/UnpicklingError...
        raise CheckpointError(f"{path}: cannot be read, the file is truncated or corrupt ({what}; "
                              f"{type(exc).__name__}: {exc})") from exc


def resolve_tag(root, tag, latest=None):
    """The tag to load and its directory, or ``(None, reason)`` when there is nothing to load.

    ``tag=None`` reads ``<root>/latest``: a missing ``latest`` means nothing to load; a
    ``latest`` naming a tag whose directory is missing is an error. An explicit tag
    whose directory does not exist means nothing to load. ``latest`` names another file
    than ``latest`` to read (``latest_universal`` for universal checkpoints): then its
    absence is an error, as upstream's.
    """
    if not os.path.isdir(root):
        return None, f"the checkpoint directory {root} does not exist"
    if tag is None and latest is not None:
        path = os.path.join(root, latest)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing; with checkpoint.load_universal it names the universal folder "
                                  f"to load (or pass the tag)")
        with open(path) as handle:
            tag = handle.read().strip()
        if not os.path.isdir(paths.tag_dir(root, tag)):
            raise CheckpointError(f"{path} names '{tag}', but {paths.tag_dir(root, tag)} does not exist")
        return check_tag(tag, latest), None
    if tag is None:
        latest = paths.read_latest(root)
        if latest is None:
            return None, (f"no '{paths.LATEST_FILE}' file in {root}; pass an explicit tag to load a checkpoint "
                          f"that was saved with save_latest=False")
        if not latest:
            raise CheckpointError(f"{paths.latest_path(root)}: empty; it should name the tag of the newest "
                                  f"checkpoint")
        try:
            tag = check_tag(latest, "latest")
        except ValueError as exc:
            raise CheckpointError(f"{paths.latest_path(root)}: {exc}") from exc
        if not os.path.isdir(paths.tag_dir(root, tag)):
            raise CheckpointError(f"{paths.latest_path(root)} names tag '{tag}', but {paths.tag_dir(root, tag)} "
                                  f"does not exist")
        return tag, None
    tag = check_tag(tag, "load_checkpoint")
    if not os.path.isdir(paths.tag_dir(root, tag)):
        return None, f"{paths.tag_dir(root, tag)} does not exist"
    return tag, None


def check_save_id(payload, path, save_id):
    """CheckpointError unless ``payload`` (an optimizer file) comes from the save that wrote the model states."""
    found = payload.get("save_id") if isinstance(payload, dict) else None
    if save_id is not None and found != save_id:
        raise CheckpointError(f"{path}: belongs to a different save than the model-states file of this tag "
                              f"(save id {found!r}, expected {save_id!r}); the directory mixes files of two saves, "
                              f"for example a save into an existing tag that did not complete")
