# SPDX-License-Identifier: Apache-2.0
"""``FastCheckpointEngine``: the writer ``checkpoint.writer`` configures, synchronous.

``type`` picks the file object every checkpoint file is serialized through (``file_writers``):

* ``python``: a buffered Python file;
* ``fast`` (upstream's default): aligned host buffers of ``io_buffer_size`` bytes written by the ``async_io`` op
  (``aio`` section: block size, queue depth, threads), two of them with ``io_buffer_double`` so that serializing
  one overlaps writing the other.

``show_statistics`` logs, per file, the bytes written, the seconds spent in the operating system's calls and the
rate. Every file is written atomically and synced, as with ``TorchCheckpointEngine``. ``mock`` (no bytes written)
is refused when the config is read: its checkpoints would not load.
"""

import torch

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from deepspeed.runtime.checkpoint_engine.file_writers import FastFileWriter, PythonFileWriter
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.utils.logging import logger

ENGINE_NAME = "FastCheckpointEngine"
WRITER_DEFAULTS = dict(type="FAST",
                       decoupled=False,
                       io_buffer_size=64 * 1024**2,
                       io_buffer_double=True,
                       show_statistics=False,
                       data_parallel=None,
                       io_multiplier=1)


def writer_config(config_params):
    """``checkpoint.writer`` of a config as a dict with upstream's defaults; None when not configured."""
    checkpoint_config = getattr(config_params, "checkpoint_config", None) if config_params is not None else None
    writer = checkpoint_config.get("writer") if checkpoint_config else None
    if writer is None:
        return None
    values = dict(WRITER_DEFAULTS)
    values.update({k: v for k, v in dict(writer).items() if v is not None or k == "data_parallel"})
    values["type"] = str(values["type"]).upper()
    return values


def _aio_settings(config_params):
    aio = getattr(config_params, "aio_config", None) or {}
    return dict(block_size=int(aio.get("block_size", 1 << 20)),
                queue_depth=int(aio.get("queue_depth", 8)),
                single_submit=bool(aio.get("single_submit", False)),
                overlap_events=bool(aio.get("overlap_events", True)),
                intra_op_parallelism=int(aio.get("thread_count", aio.get("intra_op_parallelism", 1))))


class FastCheckpointEngine(TorchCheckpointEngine):
    """See the module docstring. ``dp_writer_config`` and ``optimize_dp_state`` are upstream's arguments; which
    ranks write which files is the checkpoint layout's (docs/checkpoints.md)."""

    def __init__(self, config_params, dp_writer_config=None, optimize_dp_state=False):
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.writer = writer_config(config_params) or dict(WRITER_DEFAULTS)
        if self.writer["type"] not in ("FAST", "PYTHON"):
            raise ValueError(f"checkpoint.writer.type {self.writer['type']!r}: this engine writes 'fast' or 'python'")
        self.dp_writer_config = dp_writer_config
        self.optimize_dp_state = optimize_dp_state
        self._aio = _aio_settings(config_params)
        self._handle = None
        self._buffers = None
        self.statistics = []  # (path, bytes, seconds in the operating system's calls) per file, with show_statistics

    def _fast_resources(self):
        if self._handle is None:
            from deepspeed.ops.aio import AsyncIOBuilder
            from deepspeed.ops.aio.buffers import aligned_empty
            self._handle = AsyncIOBuilder().load(verbose=False).aio_handle(**self._aio)
            count = 2 if self.writer["io_buffer_double"] else 1
            size = max(4096, int(self.writer["io_buffer_size"]) // 4096 * 4096)
            self._buffers = [aligned_empty(size, torch.uint8) for _ in range(count)]
        return self._handle, self._buffers

    def open_file(self, path):
        if self.writer["type"] == "PYTHON":
            return _Counted(self, PythonFileWriter(path))
        handle, buffers = self._fast_resources()
        return _Counted(self, FastFileWriter(path, handle, buffers))

    def record(self, path, nbytes, seconds):
        if not self.writer["show_statistics"]:
            return
        self.statistics.append((path, nbytes, seconds))
        rate = nbytes / seconds / 1024**3 if seconds > 0 else float("inf")
        logger.info(f"[{self.name}] {path}: {nbytes} bytes, {seconds:.4f} s in write/fsync, {rate:.2f} GiB/s")

    def create(self, info: CheckpointCommitInfo):
        pass

    def cleanup(self):
        if self._handle is not None:
            self._handle.close()
            self._handle = None
            self._buffers = None


class _Counted:
    """A file writer that reports its statistics to the engine when it is closed."""

    def __init__(self, engine, inner):
        self._engine = engine
        self._inner = inner
        self.os = inner.os

    def write(self, data):
        return self._inner.write(data)

    def flush(self):
        self._inner.flush()

    def close(self):
        self._inner.close()
        self._engine.record(self.os.path, self.os.bytes_written, self.os.seconds)

    def abort(self):
        self._inner.abort()
