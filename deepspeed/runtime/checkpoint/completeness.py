# SPDX-License-Identifier: Apache-2.0
"""The completeness mark of a tag: written by rank 0 once every rank's files of a save are durable.

``<dir>/<tag>/.ds_complete`` holds the save id. A save in this package's layout records in its model-states
files that it writes the mark (``ds_checkpoint_meta["complete_mark"]``); ``load_checkpoint`` then refuses the tag
unless the mark is there and names the same save. So a save that did not finish (a rank killed while its files were
written, in the background with the decoupled writer or not) is refused by name, while checkpoints written before
marks existed, and upstream's, load as before. A save into an existing tag removes its mark first.
"""

import json
import os

from deepspeed.runtime.checkpoint import paths
from deepspeed.runtime.checkpoint.validate import CheckpointError

MARK_FILE = ".ds_complete"
META_FLAG = "complete_mark"


def mark_path(root, tag):
    return os.path.join(paths.tag_dir(root, tag), MARK_FILE)


def remove_mark(root, tag):
    try:
        os.remove(mark_path(root, tag))
    except FileNotFoundError:
        pass


def write_mark(root, tag, save_id):
    from deepspeed.runtime.checkpoint.writer import atomic_write_text
    atomic_write_text(json.dumps({"tag": str(tag), "save_id": save_id}), mark_path(root, tag))


def read_mark(root, tag):
    """The save id the tag's mark names, or None when the tag has no (readable) mark."""
    try:
        with open(mark_path(root, tag)) as handle:
            return json.load(handle).get("save_id")
    except (OSError, ValueError, AttributeError):
        return None


def _incomplete(root, tag, why):
    latest = paths.read_latest(root)
    hint = f"; 'latest' names {latest!r}, the newest complete checkpoint" if latest and latest != str(tag) else ""
    return (f"{paths.tag_dir(root, tag)}: incomplete checkpoint: the save of tag {str(tag)!r} did not finish "
            f"({why}){hint}")


def check_complete(root, tag, meta):
    """CheckpointError for a tag whose save wrote marks (``meta`` of its model-states file) and did not finish."""
    if not isinstance(meta, dict) or not meta.get(META_FLAG):
        return
    found = read_mark(root, tag)
    if found is None:
        raise CheckpointError(_incomplete(root, tag, f"no completeness mark {mark_path(root, tag)}"))
    if found != meta.get("save_id"):
        raise CheckpointError(
            _incomplete(
                root, tag, f"the completeness mark {mark_path(root, tag)} is of another save: the directory "
                f"mixes the files of two saves"))


def explain_missing(root, tag, error):
    """``error`` (a file of the tag is missing) with the incompleteness of the save said, when the tag has no
    mark; other errors as they are."""
    if ": missing (" not in str(error) or read_mark(root, tag) is not None or \
            not os.path.isdir(paths.tag_dir(root, tag)):
        return error
    return CheckpointError(_incomplete(root, tag, f"no completeness mark; {error}"))
