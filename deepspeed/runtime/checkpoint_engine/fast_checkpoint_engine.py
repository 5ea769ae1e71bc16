# SPDX-License-Identifier: Apache-2.0
"""``FastCheckpointEngine``: the writer ``checkpoint.writer`` configures, synchronous.

Every file is serialized through a buffered file of ``io_buffer_size`` bytes (``file_writers.PythonFileWriter``),
written atomically and synced, for both ``type`` values upstream writes real files with (``fast``, its default, and
``python``). ``show_statistics`` logs, per file, the bytes written, the seconds spent in the operating system's
calls and the rate. ``mock`` (no bytes written) is refused when the config is read: its checkpoints would not load.

Why ``fast`` does not go through the ``async_io`` op: serializing into aligned host buffers written by the op
(``file_writers.FastFileWriter``, double-buffered as upstream's) measured no faster than buffered writes on the
machines we could measure (CPU, ext4 and tmpfs: 256 MB in 0.8-3.1 s against 0.7-1.3 s), because ``torch.save``
hands over one tensor at a time and the copy into the aligned buffer costs what the page cache costs.
``benchmarks/checkpoint_bench.py`` measures both writers on a GPU machine's disk; ``io_buffer_double`` has no effect
(docs/checkpoints.md). What removes the write from the training loop is ``decoupled``.
"""

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from deepspeed.runtime.checkpoint_engine.file_writers import PythonFileWriter
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
        self.statistics = []  # (path, bytes, seconds in the operating system's calls) per file, with show_statistics

    def open_file(self, path):
        return _Counted(self, PythonFileWriter(path, buffer_size=max(4096, int(self.writer["io_buffer_size"]))))

    def record(self, path, nbytes, seconds):
        if not self.writer["show_statistics"]:
            return
        self.statistics.append((path, nbytes, seconds))
        rate = nbytes / seconds / 1024**3 if seconds > 0 else float("inf")
        logger.info(f"[{self.name}] {path}: {nbytes} bytes, {seconds:.4f} s in write/fsync, {rate:.2f} GiB/s")

    def create(self, info: CheckpointCommitInfo):
        pass


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
