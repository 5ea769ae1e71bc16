# SPDX-License-Identifier: Apache-2.0
"""Argument checks, and agreement between ranks so that every rank raises the same error.

Every check that can fail on one rank only (a path, a file, a tag) is done locally
first; its outcome is then exchanged with one ``all_gather_object`` (:func:`agree`),
after which either every rank goes on or every rank raises, with a message that says
what each failing rank saw. No rank is ever left waiting in a collective for a rank
that raised.
"""

import os

import deepspeed.comm as dist


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file and what is wrong.

    When a rank's failure was an error of the operating system (a full disk, a quota, a permission, an I/O error),
    ``errno``, ``strerror`` and ``filename`` are the first such rank's (on every rank), else None.
    """

    def __init__(self, *args, os_error=None):
        super().__init__(*args)
        self.errno, self.strerror, self.filename = os_error or (None, None, None)


def check_dir(path, what):
    """``path`` as a string; ValueError for None, an empty path or a non-path object."""
    if path is None:
        raise ValueError(f"{what}: the checkpoint directory is None; pass a directory path")
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise ValueError(f"{what}: the checkpoint directory must be a path, got {type(path).__name__}")
    path = os.fsdecode(os.fspath(path))
    if not path.strip():
        raise ValueError(f"{what}: the checkpoint directory is an empty string; pass a directory path")
    return path


def check_tag(tag, what):
    """``tag`` as a string usable as one directory name; ValueError otherwise."""
    if tag is None:
        raise ValueError(f"{what}: the tag is None")
    tag = str(tag)
    if not tag.strip():
        raise ValueError(f"{what}: the tag is an empty string")
    if tag != tag.strip():
        raise ValueError(f"{what}: the tag {tag!r} starts or ends with whitespace, which 'latest' cannot keep")
    if tag in (".", "..") or "/" in tag or (os.sep != "/" and os.sep in tag) or "\0" in tag:
        raise ValueError(f"{what}: the tag {tag!r} is not a single directory name")
    return tag


def _world(group):
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _describe(error):
    return f"{type(error).__name__}: {error}" if not isinstance(error, (ValueError, CheckpointError)) else str(error)


def os_error_of(error):
    """``(errno, strerror, filename)`` of the ``OSError`` behind ``error`` (itself, or its cause or context), or
    None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno is not None:
            return error.errno, error.strerror, error.filename
        if isinstance(error, CheckpointError) and error.errno is not None:
            return error.errno, error.strerror, error.filename
        error = error.__cause__ or error.__context__
    return None


def _describe_os(error, os_error):
    """The message of a failure whose cause was an ``OSError``: that error's own words, then what surfaced."""
    code, text, filename = os_error
    base = f"OSError: [Errno {code}] {text}" + (f": {filename!r}" if filename else "")
    if isinstance(error, OSError) or isinstance(error, CheckpointError):
        return base
    return f"{base} (surfaced as {type(error).__name__}: {error})"


def _kind(error):
    """How a local failure is raised on every rank: argument, unsupported or checkpoint (None: no failure)."""
    if error is None:
        return None
    if isinstance(error, ValueError) and not isinstance(error, CheckpointError):
        return "argument"
    if isinstance(error, NotImplementedError):
        return "unsupported"
    return "checkpoint"


_RAISED_AS = {"argument": ValueError, "unsupported": NotImplementedError, "checkpoint": CheckpointError}


def agree(error, value=None, group=None, comm=None):
    """Collective: exchange each rank's local outcome; return every rank's ``value`` (index = rank).

    ``error`` is the exception this rank's local checks raised, or None. If any rank
    has one, every rank raises: ValueError when every failing rank failed on its
    arguments (ValueError), NotImplementedError when all failed on that, else
    :class:`CheckpointError`. The message lists the failing ranks and their messages
    (ranks with the same message are listed together). A failure caused by an ``OSError`` is described by that
    error (errno, text, path), whatever exception carried it, and the raised :class:`CheckpointError` carries the
    first such rank's ``errno``, ``strerror`` and ``filename``. ``comm`` is the collective module
    (``deepspeed.comm`` by default; a background writer passes ``torch.distributed`` with its own ``group``).
    """
    os_error = os_error_of(error) if error is not None else None
    message = None
    if error is not None:
        message = _describe_os(error, os_error) if os_error is not None else _describe(error)
    entry = (_kind(error), message, value, os_error)
    world = _world(group)
    if world == 1:
        entries = [entry]
    else:
        entries = [None] * world
        (comm or dist).all_gather_object(entries, entry, group=group)
    failures = [(rank, kind, message) for rank, (kind, message, _, _) in enumerate(entries) if kind is not None]
    if not failures:
        return [value for _, _, value, _ in entries]
    first_os_error = next((os_error for _, _, _, os_error in entries if os_error is not None), None)
    if world == 1:
        text = failures[0][2]
    else:
        ranks_of = {}
        for rank, _, message in failures:
            ranks_of.setdefault(message, []).append(str(rank))
        text = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}: {message}"
                         for message, ranks in ranks_of.items())
    kinds = {kind for _, kind, _ in failures}
    raised = _RAISED_AS[kinds.pop()] if len(kinds) == 1 else CheckpointError
    if raised is CheckpointError:
        raise CheckpointError(text, os_error=first_os_error) from error
    raise raised(text) from error


def require_same(values, what):
    """ValueError (on every rank: ``values`` came from :func:`agree`) unless all ranks hold the same value."""
    if len(set(values)) > 1:
        listing = ", ".join(f"rank {rank}: {value!r}" for rank, value in enumerate(values))
        raise ValueError(f"{what} differs across ranks ({listing}); every rank must pass the same value")
    return values[0]
