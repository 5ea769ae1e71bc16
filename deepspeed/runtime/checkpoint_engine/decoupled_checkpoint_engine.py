# SPDX-License-Identifier: Apache-2.0
"""``DecoupledCheckpointEngine``: checkpoint files written behind training (``checkpoint.writer.decoupled``).

``save_checkpoint`` stages what the rank writes in host memory (``staging``), hands the writing and the commit to
a writer thread and returns; training goes on while the files are written. The writer thread writes
each file as the ``FastCheckpointEngine`` does (``type``: ``fast`` or ``python``; atomic, synced), then commits the
save with the other ranks over a process group of its own (gloo, made by the first decoupled save on every rank):
once every rank's files are durable, rank 0 writes the tag's completeness mark and ``latest``. A failure on any rank
(a full disk) is agreed there too, so every rank holds the same outcome; it is raised by the next
``save_checkpoint``, by :meth:`wait`, or logged by ``engine.destroy()``.

One save at a time: ``save_checkpoint`` first waits for the previous save's writes and commit; so do
``load_checkpoint``, ``engine.destroy()`` and the end of the interpreter (a save's thread is not a daemon, and ends
with its save). Call ``engine.destroy()`` before ``torch.distributed.destroy_process_group()``: the commit needs the
process group (``deepspeed.comm.destroy_process_group()`` waits by itself). A rank killed while its thread writes
leaves the tag without its completeness mark and ``latest`` naming the previous checkpoint; ``load_checkpoint``
refuses the partial tag by name.

Upstream runs the writer in a subprocess and commits at the next ``engine.step()``, which waits for the write;
here nothing on the training path waits for the disk.
"""

import datetime
import threading
import weakref

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from deepspeed.runtime.checkpoint_engine.fast_checkpoint_engine import FastCheckpointEngine
from deepspeed.runtime.checkpoint_engine.staging import stage_to_host
from deepspeed.utils.logging import logger

ENGINE_NAME = "DecoupledCheckpointEngine"
# How long a commit waits for the other ranks' writer threads (a rank that died lets the others go after it).
COMMIT_TIMEOUT = datetime.timedelta(minutes=30)

_ENGINES = weakref.WeakSet()  # every live decoupled engine, for wait_for_pending_saves


def wait_for_pending_saves():
    """Block until every decoupled save in flight in this process is written and committed (failures stay with
    their engines). ``deepspeed.comm.destroy_process_group()`` calls it: a commit needs the process group."""
    for engine in list(_ENGINES):
        thread = engine._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()


class DecoupledCheckpointEngine(FastCheckpointEngine):
    """See the module docstring."""

    def __init__(self, config_params, dp_writer_config=None, optimize_dp_state=False):
        super().__init__(config_params, dp_writer_config, optimize_dp_state)
        self.name = ENGINE_NAME
        self.commit_info = None
        self._thread = None  # the writer thread of the newest save (each save gets one; it ends with the save)
        self._lock = threading.Lock()
        self._error = None
        self._group = None
        _ENGINES.add(self)

    # ---------------------------------------------------------- the thread
    def submit(self, job):
        """Run ``job()`` on a writer thread of its own, after the jobs submitted before (not a daemon: the end of
        the interpreter waits for it)."""
        previous = self._thread

        def run():
            if previous is not None:
                previous.join()
            try:
                job()
            except BaseException as exc:  # kept for the training thread
                with self._lock:
                    if self._error is None:
                        self._error = exc

        self._thread = threading.Thread(target=run, name="ds-checkpoint-writer", daemon=False)
        self._thread.start()

    def busy(self):
        """Whether a save is still being written or committed."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self):
        """Block until every submitted save is written and committed; raise the first failure (once)."""
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def commit_group(self):
        """The process group commits agree over (every rank; gloo). Collective the first time: call it from the
        training thread of every rank, in a save."""
        import torch.distributed as dist
        if self._group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo", timeout=COMMIT_TIMEOUT)
        return self._group

    # ------------------------------------------------- upstream's interface
    def create(self, info: CheckpointCommitInfo):
        self.commit_info = info

    def save(self, state_dict, path: str):
        """Stage ``state_dict`` in host memory now and write it to ``path`` on the writer thread."""
        staged = stage_to_host([state_dict])[0]
        self.submit(lambda: self.write_file(staged, path))

    def commit(self, info: CheckpointCommitInfo):
        """Wait until the files of ``info`` are written (raising a failure); True."""
        self.wait()
        self.commit_info = None
        return True

    def get_commit_info(self):
        return self.commit_info

    def is_decoupled(self):
        return True

    def cleanup(self):
        """Wait for the writes in flight and stop the writer thread (a failure is logged, not raised)."""
        try:
            self.wait()
        except Exception as exc:
            logger.error(f"[{ENGINE_NAME}] the last checkpoint save failed: {exc}", exc_info=exc)
        self._thread = None
        self.commit_info = None
        super().cleanup()
