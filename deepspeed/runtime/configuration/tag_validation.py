# SPDX-License-Identifier: Apache-2.0
"""``checkpoint.tag_validation``: what ``save_checkpoint`` does when the ranks pass different tags.

The tags of all ranks are compared (they are gathered before anything is written, so every rank decides the
same way):

* ``FAIL``: :class:`CheckpointTagMismatchError` (a ``ValueError`` and an ``AssertionError``, as upstream asserts)
  on every rank, before any file is written;
* ``WARN`` (the default): a warning on every rank naming the tags, then each rank writes its files under its own
  tag, as upstream does (such a checkpoint loads only where the same tags are given again);
* ``IGNORE``: each rank writes under its own tag, silently.
"""

from deepspeed.runtime.constants import ValidationMode
from deepspeed.utils.logging import logger


class CheckpointTagMismatchError(ValueError, AssertionError):
    """The ranks passed different checkpoint tags and ``checkpoint.tag_validation`` is ``FAIL``."""


def resolve_tag(tags, rank, config):
    """The tag rank ``rank`` saves under, given every rank's tag (``tags[r]``) and the engine's config."""
    own = tags[rank]
    if len(set(tags)) == 1:
        return own
    listing = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
    message = (f"save_checkpoint: the checkpoint tag is not consistent across ranks ({listing}); a tag with "
               f"rank-specific parts cannot be restored on another world size")
    if getattr(config, "checkpoint_tag_validation_fail", False):
        raise CheckpointTagMismatchError(f"{message} (checkpoint.tag_validation is {ValidationMode.FAIL})")
    if getattr(config, "checkpoint_tag_validation_enabled", True):
        logger.warning(f"{message}; each rank saves under its own tag (checkpoint.tag_validation is "
                       f"{ValidationMode.WARN})")
    return own
