# SPDX-License-Identifier: Apache-2.0
"""One rank of the multi-rank test pool: a long-lived process that runs test functions on request.

A worker is started (spawn) by `WorkerPool` with a `WorkerSpec` and one end of a pipe. It detaches into its own session
(so the pool can kill it with everything it started), sends its stdout/stderr to a per-rank log file, imports torch,
joins the pool's gloo process group and then serves calls until told to stop or until the pipe closes.

Contract of one call, as seen by the test function:
- `torch.distributed` is initialized (gloo, the pool's rank and world size); if an earlier call destroyed the default
  group on every rank, it is initialized again from the environment.
- `os.environ` and the working directory are those the worker started with (RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT set); changes a previous call made to them are undone.
- `torch.set_num_threads(1)`; `torch`, `random` and `numpy` are seeded with `1234 + rank`; default dtype float32;
  grad mode on.
- The log file holds only this call's output (it is truncated when the call starts).
The deepspeed package is never imported here; only test code imports it.
"""

import datetime
import faulthandler
import gc
import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Dict

BASE_SEED = 1234
PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=30)
PARENT_POLL_S = 2.0
DUMP_STACKS_SIGNAL = signal.SIGUSR1

_in_worker = False


def in_worker() -> bool:
    """True inside a pool worker process (where a nested pool call would deadlock)."""
    return _in_worker


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker needs to start; picklable and sent at spawn."""
    rank: int
    world_size: int
    master_port: int
    log_path: str
    environ: Dict[str, str]
    parent_pid: int
    master_addr: str = "127.0.0.1"

    def rank_environ(self) -> Dict[str, str]:
        env = dict(self.environ)
        env.update(RANK=str(self.rank),
                   WORLD_SIZE=str(self.world_size),
                   LOCAL_RANK=str(self.rank),
                   LOCAL_WORLD_SIZE=str(self.world_size),
                   MASTER_ADDR=self.master_addr,
                   MASTER_PORT=str(self.master_port),
                   OMP_NUM_THREADS="1")
        return env


def worker_main(spec: WorkerSpec, conn) -> None:
    """Process entry point: start up, report ready (or the startup traceback), then serve calls."""
    global _in_worker
    _in_worker = True
    _detach_and_redirect(spec.log_path)
    os.environ.clear()
    os.environ.update(spec.rank_environ())
    _exit_when_orphaned(spec.parent_pid)
    try:
        state = _WorkerState(spec)
    except BaseException:
        conn.send(("startup_failed", traceback.format_exc()))
        _flush_streams()
        return
    state.collect_garbage()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message[0] == "stop":
            break
        conn.send_bytes(state.serve(message[1]))
        # Collect between calls, after the reply, so the caller does not wait for it.
        state.collect_garbage()
    state.close()
    _flush_streams()


def _detach_and_redirect(log_path: str) -> None:
    """Own session (so killpg reaches everything this worker starts); stdout/stderr into the rank's log file."""
    try:
        os.setsid()
    except OSError:
        pass
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.reconfigure(line_buffering=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # The pool sends this signal to a rank that did not answer, so the log shows where it is stuck.
    faulthandler.register(DUMP_STACKS_SIGNAL, file=sys.stderr, all_threads=True)


def _exit_when_orphaned(parent_pid: int) -> None:
    """Leave no worker behind if the test process dies without shutting the pool down."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(70)

    threading.Thread(target=watch, name="pool-parent-watch", daemon=True).start()


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


class _WorkerState:
    """The torch side of a worker: process group, the per-call reset and the reply of one call."""

    def __init__(self, spec: WorkerSpec):
        import torch
        import torch.distributed as dist
        self.spec = spec
        self.torch = torch
        self.dist = dist
        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass  # only allowed before any inter-op work; harmless to skip
        try:
            import numpy
            self.numpy = numpy
        except ImportError:
            self.numpy = None
        self._init_process_group()
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.modules_at_freeze = 0

    def collect_garbage(self) -> None:
        """A full gc.collect(), kept cheap by freezing long-lived objects out of later passes.

        Note: a full pass over the objects of torch (and later deepspeed) costs 0.1-0.3 s on a small machine, and it
        runs between every two tests. Module objects live as long as the process, so whenever a pass finds that new
        modules were imported since the last freeze, everything still alive is moved to the permanent generation
        (gc.freeze) and later passes only walk what tests created since. Frozen objects are still freed by reference
        counting; only reference cycles that were alive at a freeze and die later are never reclaimed.
        """
        gc.collect()
        if len(sys.modules) != self.modules_at_freeze:
            gc.freeze()
            self.modules_at_freeze = len(sys.modules)

    def _init_process_group(self) -> None:
        self.dist.init_process_group("gloo",
                                     init_method="env://",
                                     rank=self.spec.rank,
                                     world_size=self.spec.world_size,
                                     timeout=PROCESS_GROUP_TIMEOUT)

    def _begin_call(self) -> None:
        _flush_streams()
        os.ftruncate(1, 0)  # fd 1 and 2 share the log file, opened O_APPEND: writes restart at offset 0
        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        torch = self.torch
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        seed = BASE_SEED + self.spec.rank
        torch.manual_seed(seed)
        random.seed(seed)
        if self.numpy is not None:
            self.numpy.random.seed(seed)
        if not self.dist.is_initialized():
            self._init_process_group()
        groups = sys.modules.get("deepspeed.utils.groups")
        if groups is not None:  # every call starts without a mesh (its groups stay cached)
            groups.reset_mesh()

    def sync_fingerprint(self):
        """Counters that every rank has equal iff all ranks issued the same collectives and group creations.

        The pool compares them after a call; ranks that disagree would pair wrong collectives in the next test.
        """
        if not self.dist.is_initialized():
            return None
        c10d = self.dist.distributed_c10d
        try:
            sequence = c10d._get_default_group()._get_sequence_number_for_group()
        except (AttributeError, RuntimeError):
            sequence = None
        return (sequence, getattr(c10d._world, "group_count", None))

    def serve(self, payload: bytes) -> bytes:
        """Run one pickled (fn, args, kwargs) and return the pickled reply dict."""
        try:
            self._begin_call()
            fn, args, kwargs = pickle.loads(payload)
            value = fn(*args, **kwargs)
        except BaseException as exc:  # SystemExit from a test function is a failure to report, too
            return self._raised(exc, "")
        finally:
            _flush_streams()
        try:
            return pickle.dumps(dict(status="ok", value=value, fingerprint=self.sync_fingerprint()))
        except BaseException as exc:
            return self._raised(exc, "the return value could not be pickled\n")

    def _raised(self, exc: BaseException, prefix: str) -> bytes:
        summary = traceback.format_exception_only(type(exc), exc)[-1].strip()
        frames = exc.__traceback__
        if frames is not None and frames.tb_next is not None:
            frames = frames.tb_next  # drop this module's own frame; the report starts in the test code
        detail = prefix + "".join(traceback.format_exception(type(exc), exc, frames))
        return pickle.dumps(dict(status="raised", summary=summary, detail=detail, fingerprint=self.sync_fingerprint()))

    def close(self) -> None:
        if self.dist.is_initialized():
            try:
                self.dist.destroy_process_group()
            except Exception:  # shutting down; the pool kills a worker that does not exit
                pass
