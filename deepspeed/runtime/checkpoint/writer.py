# SPDX-License-Identifier: Apache-2.0
"""Atomic file writes, and the test hook that pauses a save between two files.

A file is written under a temporary name in its final directory, flushed to disk and
renamed over the final name (``os.replace``, atomic on POSIX): a reader sees either
the previous file or the complete new one, never a partial file under a checkpoint
name. A crash leaves at most a ``.<name>.tmp-*`` file behind, which loaders ignore.
``torch.save`` writes through a file object of ``checkpoint_engine.file_writers``, so that a
failed write raises the operating system's error (``No space left on device`` and the path),
not torch's account of it.

Test hook: with ``DS_CHECKPOINT_TEST_PAUSE_AFTER_FILES=<n>`` in a rank's environment,
its :class:`SaveWriter` sleeps forever once it has written ``n`` files of one save
(``n = 0``: before the first), so that a test can kill the rank in the middle of a
save. If ``DS_CHECKPOINT_TEST_PAUSE_MARKER`` names a path, that file is created when
the pause begins.
"""

import os
import sys
import time

from deepspeed.runtime.checkpoint.paths import temp_path

PAUSE_AFTER_FILES_ENV = "DS_CHECKPOINT_TEST_PAUSE_AFTER_FILES"
PAUSE_MARKER_ENV = "DS_CHECKPOINT_TEST_PAUSE_MARKER"


def _fsync_dir(directory):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not sync directories; the rename is still atomic
    finally:
        os.close(fd)


def _replace_atomically(path, write_to):
    """Run ``write_to(temporary path)`` and rename the result to ``path``; on any failure the temporary file is
    removed and the error raised (an operating-system error named by ``path``, not its temporary name)."""
    tmp = temp_path(path)
    try:
        try:
            write_to(tmp)
            os.replace(tmp, path)
        except OSError as exc:
            if exc.errno is None or exc.filename == path:
                raise
            raise OSError(exc.errno, exc.strerror, path) from exc
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(os.path.dirname(path) or ".")


def _atomic(path, write):
    """Run ``write(handle)`` on a temporary file, sync it, and rename it to ``path``."""

    def write_to(tmp):
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())

    _replace_atomically(path, write_to)


def atomic_serialize(obj, path, open_file, zipfile=True):
    """``torch.save(obj)`` to ``path`` atomically, through the file object ``open_file(temporary path)`` returns
    (``checkpoint_engine.file_writers``: it syncs when closed); a failure raises the operating system's error."""
    from deepspeed.runtime.checkpoint_engine.file_writers import serialize
    _replace_atomically(path, lambda tmp: serialize(obj, open_file(tmp), zipfile))


def atomic_torch_save(obj, path):
    """``torch.save(obj)`` to ``path``, atomically (zipfile format)."""
    from deepspeed.runtime.checkpoint_engine.file_writers import PythonFileWriter
    atomic_serialize(obj, path, PythonFileWriter)


def atomic_write_text(text, path):
    """Write ``text`` to ``path``, atomically."""
    _atomic(path, lambda handle: handle.write(text.encode("utf-8")))


def atomic_copy(source, path):
    """Copy the file ``source`` to ``path``, atomically."""

    def write(handle):
        with open(source, "rb") as src:
            handle.write(src.read())

    _atomic(path, write)


class SaveWriter:
    """Writes the files of one save on one rank and counts them for the test pause hook.

    ``checkpoint_engine`` (a ``CheckpointEngine``) writes each file; None: :func:`atomic_torch_save`. With
    ``defer``, :meth:`save` only collects ``(path, payload)`` in :attr:`deferred`; a background writer stages them
    and calls :meth:`write_deferred` later (the pause hook then pauses that writer).
    """

    def __init__(self, checkpoint_engine=None, defer=False):
        value = os.environ.get(PAUSE_AFTER_FILES_ENV)
        self._pause_after = int(value) if value not in (None, "") else None
        self._engine = checkpoint_engine
        self.written = []
        self.deferred = [] if defer else None
        if not defer:
            self._maybe_pause()

    def save(self, obj, path):
        if self.deferred is not None:
            self.deferred.append((path, obj))
            return
        self._write(obj, path)

    def _write(self, obj, path):
        if self._engine is None:
            atomic_torch_save(obj, path)
        else:  # now, on this thread (a decoupled engine's own ``save`` would hand it to another writer thread)
            getattr(self._engine, "write_file", self._engine.save)(obj, path)
        self._wrote(path)

    def write_deferred(self, files):
        """Write ``[(path, payload)]`` now (on the background writer's thread)."""
        self._maybe_pause()
        for path, obj in files:
            self._write(obj, path)

    def write_text(self, text, path):
        atomic_write_text(text, path)
        self._wrote(path)

    def _wrote(self, path):
        self.written.append(path)
        self._maybe_pause()

    def _maybe_pause(self):
        if self._pause_after is None or len(self.written) != self._pause_after:
            return
        sys.stderr.write(f"{PAUSE_AFTER_FILES_ENV}: pausing after {len(self.written)} file(s): {self.written}\n")
        sys.stderr.flush()
        marker = os.environ.get(PAUSE_MARKER_ENV)
        if marker:
            atomic_write_text(f"{os.getpid()}\n", marker)
        while True:
            time.sleep(3600)
