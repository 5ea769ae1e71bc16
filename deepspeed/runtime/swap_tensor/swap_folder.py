# SPDX-License-Identifier: Apache-2.0
"""The folder one rank swaps into, and the checks that make a bad ``nvme_path`` fail at start, not mid-run.

Layout (upstream's folders): ``{nvme_path}/zero_stage_3/{dtype}params/rank{r}/`` for ZeRO-3 parameter shards
(``bfloat16params``, ``float16params``, ...) and ``{nvme_path}/zero_stage_3/optimizer/rank{r}/`` for the fp32 masters
and optimizer moments, whatever the stage. The files in them are this package's (one file per param group and field,
``{name}.tensor.swp``): a cache of the training state, never a checkpoint.

:class:`SwapFolder` opens a rank's folder:

* ``nvme_path`` must exist and be a writable folder: otherwise :class:`SwapConfigError` names the config key, the path
  and the reason (every rank checks its own before any collective);
* a lock file (``flock``) marks the folder as used by this process; a second live process that opens the same folder
  gets an error naming the holder's pid. A folder whose lock nobody holds was left by a run that ended or was
  killed: its files are stale and are deleted before anything is written, so nothing of a former run is ever read;
* :meth:`SwapFolder.reserve` allocates each file's full size at start (``posix_fallocate``), so a disk that cannot
  hold the state fails at start with the sizes in the message, and a write later never needs a new block;
* :meth:`SwapFolder.probe_direct` finds out once whether the file system takes ``O_DIRECT`` (tmpfs before Linux 6.6
  and some network or FUSE file systems do not); where it does not, the aio handle uses buffered I/O (the page cache
  then holds swapped data) and one warning says so.
"""

import errno
import fcntl
import os
import shutil

from deepspeed.utils.logging import logger

SWAP_SUFFIX = ".tensor.swp"
LOCK_NAME = ".lock"


class SwapConfigError(ValueError):
    """An ``nvme_path`` (or what is under it) cannot be used for swapping."""


def param_folder(nvme_path, dtype, rank):
    """``{nvme_path}/zero_stage_3/{dtype}params/rank{rank}`` (upstream's folder of ZeRO-3 parameter shards)."""
    name = str(dtype).split(".")[-1]
    return os.path.join(nvme_path, "zero_stage_3", f"{name}params", f"rank{rank}")


def optimizer_folder(nvme_path, rank):
    """``{nvme_path}/zero_stage_3/optimizer/rank{rank}`` (upstream's folder of the swapped optimizer state)."""
    return os.path.join(nvme_path, "zero_stage_3", "optimizer", f"rank{rank}")


def check_nvme_path(nvme_path, key):
    """Raise :class:`SwapConfigError` unless ``nvme_path`` is an existing, writable folder (``key`` names the config
    key in the message)."""
    if not nvme_path:
        raise SwapConfigError(f"config key '{key}' is required for NVMe offload")
    if not os.path.exists(nvme_path):
        raise SwapConfigError(f"config key '{key}': {nvme_path} does not exist; create it on the NVMe device")
    if not os.path.isdir(nvme_path):
        raise SwapConfigError(f"config key '{key}': {nvme_path} is not a folder")
    if not os.access(nvme_path, os.W_OK | os.X_OK):
        raise SwapConfigError(f"config key '{key}': {nvme_path} is not writable by this process")


def nvme_path_verdict(zero_config):
    """``"usable"``, or why an ``nvme_path`` of the ``offload_*`` sections with ``device: nvme`` is not (what
    ``deepspeed.initialize`` compares across ranks before its first collective)."""
    problems = []
    for name in ("offload_optimizer", "offload_param"):
        section = getattr(zero_config, name, None)
        if section is None or str(getattr(section.device, "value", section.device)) != "nvme":
            continue
        try:
            check_nvme_path(section.nvme_path, f"zero_optimization.{name}.nvme_path")
        except SwapConfigError as error:
            problems.append(str(error))
    return "; ".join(problems) or "usable"


class SwapFolder:
    """One rank's swap folder (see the module docstring); ``key`` is the config key of ``nvme_path`` for messages."""

    def __init__(self, path, key):
        self.path = path
        self.key = key
        self._lock_fd = None
        self._direct = None
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as error:
            raise SwapConfigError(f"config key '{key}': cannot create {path}: {error.strerror}") from None
        self._lock()
        self._clear_stale()

    def _lock(self):
        lock_path = os.path.join(self.path, LOCK_NAME)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise SwapConfigError(f"config key '{self.key}': cannot write in {self.path}: {error.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise SwapConfigError(f"config key '{self.key}': {self.path} is in use by pid {holder}; give each run "
                                  f"(and each rank) its own nvme_path") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def _clear_stale(self):
        stale = [name for name in os.listdir(self.path) if name != LOCK_NAME]
        for name in stale:
            target = os.path.join(self.path, name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            else:
                os.unlink(target)
        if stale:
            logger.info(f"removed {len(stale)} stale swap files of an earlier run from {self.path}")

    def file(self, name):
        """The path of swap file ``name`` (``{name}.tensor.swp``)."""
        return os.path.join(self.path, name + SWAP_SUFFIX)

    def reserve(self, sizes):
        """Create the files ``{path: bytes}`` (paths of :meth:`file`) at their full size on disk;
        :class:`SwapConfigError` if they do not fit."""
        total = sum(sizes.values())
        free = shutil.disk_usage(self.path).free
        if total > free:
            raise SwapConfigError(f"config key '{self.key}': the swap files need {total / 1e9:.2f} GB in {self.path}, "
                                  f"{free / 1e9:.2f} GB are free")
        for path, nbytes in sizes.items():
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                if nbytes:
                    try:
                        os.posix_fallocate(fd, 0, nbytes)
                    except OSError as error:
                        if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                            raise SwapConfigError(
                                f"config key '{self.key}': cannot allocate {nbytes / 1e9:.2f} GB for "
                                f"{path}: {error.strerror}") from None
                        os.ftruncate(fd, nbytes)  # a file system without fallocate: sparse, blocks come on write
            finally:
                os.close(fd)

    def probe_direct(self, io):
        """Whether this folder's file system takes ``O_DIRECT``, found out once with the aio engine ``io`` (one
        aligned 4 KiB write); where it does not, one warning says that the page cache is used instead."""
        if self._direct is None:
            from deepspeed.ops.aio.buffers import aligned_empty
            probe = os.path.join(self.path, ".direct_probe")
            buffer = aligned_empty(4096, pin=False)
            refused = io.direct_refused()
            try:
                io.wait_op(io.submit(True, buffer.data_ptr(), 4096, probe, None, 0))
            except OSError as error:
                raise SwapConfigError(f"config key '{self.key}': cannot write in {self.path}: {error}") from None
            finally:
                if os.path.exists(probe):
                    os.unlink(probe)
            self._direct = io.direct_refused() == refused
            if not self._direct:
                logger.warning(f"the file system of {self.path} refuses O_DIRECT; NVMe offload reads and writes it "
                               "through the page cache (buffered I/O), which holds the swapped data in host memory "
                               "too")
        return self._direct

    def close(self, remove_files=True):
        """Remove the swap files (they are a cache) and release the lock."""
        if self._lock_fd is None:
            return
        if remove_files:
            for name in os.listdir(self.path):
                if name.endswith(SWAP_SUFFIX):
                    try:
                        os.unlink(os.path.join(self.path, name))
                    except OSError:
                        pass
        os.close(self._lock_fd)
        self._lock_fd = None
