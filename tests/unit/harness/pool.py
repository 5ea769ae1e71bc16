# SPDX-License-Identifier: Apache-2.0
"""A pool of live worker processes, one per rank, that runs test functions on all ranks at once.

Life cycle: `WorkerPool(world_size)` holds no processes until the first `call` (or `start`). `start` spawns the ranks,
each in its own session with its own log file, and waits until all joined the gloo group. `call` sends one function to
every rank and gathers one `RankOutcome` per rank. `kill` removes every process of the pool (and what they started);
the next `call` starts a fresh set. `close` asks the ranks to exit and kills those that do not.

When a call ends, the pool is kept only if it is known to be consistent: every rank replied and all ranks agree on
their collective counters (see `worker._WorkerState.sync_fingerprint`). Otherwise it is killed, so one broken test
cannot pair its leftover collectives with the next test's.
"""

import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import multiprocessing
import multiprocessing.util  # noqa: F401  (its atexit join must run after ours, so it must register first)
from multiprocessing.connection import wait
from typing import Any, Callable, Dict, List, Optional, Sequence

from .outcome import DistributedTestError, RankOutcome, Status, format_report, tail
from .worker import DUMP_STACKS_SIGNAL, WorkerSpec, worker_main

START_TIMEOUT_S = 300.0
FAILURE_GRACE_S = 10.0
SETTLE_S = 1.0
STOP_TIMEOUT_S = 10.0
STACK_DUMP_WAIT_S = 0.5
LOG_READ_BYTES = 16384

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# The environment workers start from: the one the test session started with, not one a running test patched.
_SESSION_ENVIRON = dict(os.environ)
_ports_taken = set()


def _free_port() -> int:
    """A TCP port that nothing listens on now and that no other pool of this session got."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _ports_taken:
            _ports_taken.add(port)
            return port


def _ensure_repo_root_importable() -> None:
    """Spawned workers copy this sys.path; they must import `tests.*` whatever the caller's cwd is."""
    if not any(os.path.abspath(entry or os.curdir) == _REPO_ROOT for entry in sys.path):
        sys.path.insert(0, _REPO_ROOT)


def _describe(fn: Callable) -> str:
    name = getattr(fn, "__qualname__", None)
    if name is None:
        return repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else name


class WorkerPool:
    """`world_size` spawned ranks of one gloo group, reused across calls."""

    def __init__(self, world_size: int, start_timeout: float = START_TIMEOUT_S):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.start_timeout = start_timeout
        self._procs: List[multiprocessing.Process] = []
        self._conns = []
        self._log_dir: Optional[str] = None
        self.master_port: Optional[int] = None
        self.pids: List[int] = []
        self.starts = 0
        self._stop_requested = self._broken = False

    @property
    def started(self) -> bool:
        return bool(self._procs)

    def _alive(self) -> bool:
        return self.started and all(proc.is_alive() for proc in self._procs)

    def _log_path(self, rank: int) -> str:
        return os.path.join(self._log_dir, f"rank{rank}.log")

    def start(self) -> None:
        """Spawn all ranks and wait until every one joined the process group; raise DistributedTestError if not."""
        if self.started:
            return
        _ensure_repo_root_importable()
        context = multiprocessing.get_context("spawn")
        self._log_dir = tempfile.mkdtemp(prefix=f"ds-test-pool-ws{self.world_size}-")
        self.master_port = _free_port()
        self.starts += 1
        try:
            self._spawn(context)
        except BaseException:  # e.g. spawning from a module without a __main__ guard: leave nothing behind
            self.kill()
            raise
        outcomes = self._await_ready()
        if not all(outcome.ok for outcome in outcomes):
            self._attach_output(outcomes)
            self.kill()
            title = f"the worker pool of world size {self.world_size} failed to start"
            raise DistributedTestError(format_report(title, outcomes), outcomes)
        self.pids = [outcome.value for outcome in outcomes]

    def _spawn(self, context) -> None:
        for rank in range(self.world_size):
            spec = WorkerSpec(rank=rank,
                              world_size=self.world_size,
                              master_port=self.master_port,
                              log_path=self._log_path(rank),
                              environ=_SESSION_ENVIRON,
                              parent_pid=os.getpid())
            parent_end, child_end = context.Pipe(duplex=True)
            proc = context.Process(target=worker_main,
                                   args=(spec, child_end),
                                   name=f"test-pool-ws{self.world_size}-rank{rank}")
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)

    def _await_ready(self) -> List[RankOutcome]:
        outcomes: List[Optional[RankOutcome]] = [None] * self.world_size
        deadline = time.monotonic() + self.start_timeout
        pending = set(range(self.world_size))
        while pending and time.monotonic() < deadline:
            self._wait(pending, deadline)
            for rank in sorted(pending):
                outcome = self._poll_startup(rank)
                if outcome is not None:
                    outcomes[rank] = outcome
                    pending.discard(rank)
            if any(outcome is not None and not outcome.ok for outcome in outcomes):
                break  # the group can no longer form
        for rank in pending:
            reason = f"not ready within {self.start_timeout:.0f} s" if time.monotonic() >= deadline else \
                "did not finish starting (another rank failed)"
            outcomes[rank] = RankOutcome(rank, Status.NO_REPLY, summary=reason)
        return outcomes

    def _poll_startup(self, rank: int) -> Optional[RankOutcome]:
        conn, proc = self._conns[rank], self._procs[rank]
        if conn.poll():
            try:
                kind, body = conn.recv()
            except (EOFError, OSError):
                return self._died(rank)
            if kind == "ready":
                return RankOutcome(rank, Status.OK, value=body)
            return RankOutcome(rank, Status.RAISED, summary="startup failed", detail=body)
        if not proc.is_alive():
            return self._died(rank)
        return None

    def _wait(self, ranks, deadline: float) -> None:
        waitables = [self._conns[rank] for rank in ranks] + [self._procs[rank].sentinel for rank in ranks]
        wait(waitables, timeout=max(0.0, deadline - time.monotonic()))

    def _died(self, rank: int) -> RankOutcome:
        proc = self._procs[rank]
        proc.join(timeout=1.0)
        return RankOutcome(rank, Status.DIED, summary=f"the worker process exited with code {proc.exitcode}")

    def call(self,
             fn: Callable,
             args: Sequence = (),
             kwargs: Optional[Dict[str, Any]] = None,
             timeout: float = 120.0,
             grace: float = FAILURE_GRACE_S) -> List[Any]:
        """Run fn(*args, **kwargs) on every rank; return the per-rank results or raise DistributedTestError.

        `timeout` bounds the call from the moment it is sent (pool start-up is not counted). Once a rank has failed,
        the others get at most `grace` more seconds; those still busy after `SETTLE_S` are likely blocked on the
        failed rank in a collective, so the failed rank is then killed, which makes them fail at once ("connection
        reset") with a traceback that shows where they waited. Ranks without a reply get their Python stacks dumped
        into their output.
        """
        payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
        if self.started and (self._broken or not self._alive()):
            self.kill()
        self.start()
        try:
            outcomes, fingerprints, reason = self._collect(payload, timeout, grace)
        except BaseException:  # e.g. KeyboardInterrupt: the ranks' state is unknown
            self.kill()
            raise
        # A rank killed during the grace period leaves the survivors' group broken even if they all answered.
        consistent = not self._broken and self._alive() and len(set(fingerprints)) == 1 and \
            all(outcome.status in (Status.OK, Status.RAISED) for outcome in outcomes)
        failed = not all(outcome.ok for outcome in outcomes)
        if failed:
            self._attach_output(outcomes)
        if not consistent:
            self.kill()
        if failed:
            bad = [outcome.rank for outcome in outcomes if not outcome.ok]
            title = f"{_describe(fn)} failed on rank(s) {bad} of world size {self.world_size}"
            if reason:
                title += f"; {reason}"
            if not consistent:
                title += f"; the pool of world size {self.world_size} was killed and restarts on next use"
            raise DistributedTestError(format_report(title, outcomes), outcomes)
        return [outcome.value for outcome in outcomes]

    def _collect(self, payload: bytes, timeout: float, grace: float):
        outcomes: List[Optional[RankOutcome]] = [None] * self.world_size
        fingerprints = [None] * self.world_size
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(("call", payload))
            except OSError:
                outcomes[rank] = self._died(rank)
        pending = {rank for rank in range(self.world_size) if outcomes[rank] is None}
        deadline = time.monotonic() + timeout
        grace_deadline = unblock_at = None
        while pending:
            failed = [o.rank for o in outcomes if o is not None and o.status in (Status.RAISED, Status.DIED)]
            now = time.monotonic()
            if failed and grace_deadline is None:
                grace_deadline, unblock_at = now + grace, now + min(SETTLE_S, grace)
            if unblock_at is not None and now >= unblock_at:
                unblock_at = None
                for rank in failed:
                    self._kill_rank(rank)  # peers waiting on it in gloo now get "connection reset" at once
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            if now >= limit:
                break
            self._wait(pending, limit if unblock_at is None else min(limit, unblock_at))
            for rank in sorted(pending):
                received = self._poll_reply(rank)
                if received is not None:
                    outcomes[rank], fingerprints[rank] = received
                    pending.discard(rank)
        reason = ""
        if pending:
            if grace_deadline is not None and grace_deadline <= deadline:
                detail = f"no reply within the grace period ({grace:.1f} s) after another rank failed"
            else:
                detail = f"no reply within the timeout ({timeout:.1f} s)"
            reason = f"rank(s) {sorted(pending)} did not answer: {detail}"
            self._dump_stacks(pending)
            for rank in pending:
                outcomes[rank] = RankOutcome(rank, Status.NO_REPLY, summary=detail)
        return outcomes, fingerprints, reason

    def _poll_reply(self, rank: int):
        conn, proc = self._conns[rank], self._procs[rank]
        if conn.poll():
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                return self._died(rank), None
            try:
                reply = pickle.loads(data)
            except Exception as exc:
                return RankOutcome(rank, Status.RAISED, summary="reply could not be unpickled", detail=repr(exc)), None
            if reply["status"] == "ok":
                return RankOutcome(rank, Status.OK, value=reply["value"]), reply["fingerprint"]
            outcome = RankOutcome(rank, Status.RAISED, summary=reply["summary"], detail=reply["detail"])
            return outcome, reply["fingerprint"]
        if not proc.is_alive():
            return self._died(rank), None
        return None

    def _dump_stacks(self, ranks) -> None:
        for rank in ranks:
            try:
                os.kill(self._procs[rank].pid, DUMP_STACKS_SIGNAL)
            except (OSError, TypeError):
                pass
        time.sleep(STACK_DUMP_WAIT_S)

    def _attach_output(self, outcomes: List[RankOutcome]) -> None:
        for outcome in outcomes:
            outcome.output = self._read_log(outcome.rank)

    def _read_log(self, rank: int) -> str:
        try:
            with open(self._log_path(rank), "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - LOG_READ_BYTES))
                return tail(log.read().decode("utf-8", errors="replace"))
        except OSError:
            return ""

    def _kill_rank(self, rank: int) -> None:
        """SIGKILL the rank's whole session (the worker and anything it started); the pool is broken from now on."""
        self._broken = True
        proc = self._procs[rank]
        if proc.pid is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # not (yet) a session leader, or already gone
        if proc.is_alive():
            proc.kill()

    def kill(self) -> None:
        """Remove every process of the pool at once; the next call starts a fresh set."""
        for rank in range(len(self._procs)):
            self._kill_rank(rank)
        for proc in self._procs:
            proc.join(timeout=STOP_TIMEOUT_S)
        self._release()

    def request_stop(self) -> None:
        """Ask every rank to exit after its current call, without waiting (lets several pools stop in parallel)."""
        if self._stop_requested:
            return
        self._stop_requested = True
        for conn in self._conns:
            try:
                conn.send(("stop", None))
            except OSError:
                pass

    def close(self) -> None:
        """Ask every rank to exit, wait a little, then kill what is left."""
        if not self.started:
            return
        self.request_stop()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def _release(self) -> None:
        for conn in self._conns:
            conn.close()
        for proc in self._procs:
            if not proc.is_alive():
                proc.close()
        self._procs, self._conns, self.pids = [], [], []
        self._stop_requested = self._broken = False
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None
