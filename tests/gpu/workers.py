# SPDX-License-Identifier: Apache-2.0
"""A group of long-lived ranks that run module-level functions together, on NCCL (one GPU per rank) or gloo.

The ranks are started once (``torch.multiprocessing``, spawn) and then serve many calls, so process start, CUDA
initialisation and communicator set-up are paid once. ``RankGroup.call(fn, args, timeout)`` runs ``fn(*args)`` on
every rank and returns one ``Outcome`` per rank:

* every rank returned: the group is kept for the next call;
* anything else (a rank raised, died, or did not answer within ``timeout``; after the first rank raised the others
  get ``grace`` seconds, since they are usually stuck in a collective the failed rank never issues): every rank is
  killed and the next call starts a fresh group on a new port. A group whose ranks may disagree on which collectives
  they issued is never reused.

Each rank writes its output to a log file that is emptied at the start of each call; on failure the tail of that
call's output is in ``Outcome.output``.
"""

import datetime
import os
import pickle
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable, List, Sequence

START_TIMEOUT_S = 300.0
GRACE_S = 15.0
OUTPUT_TAIL_CHARS = 3000
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Outcome:
    """One rank's end of one call: ``status`` is "ok", "raised", "died" or "no reply"."""
    rank: int
    status: str
    value: Any = None
    detail: str = ""
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def report(self) -> str:
        text = f"--- rank {self.rank}: {self.status}\n{self.detail}"
        if self.output:
            text += f"\n--- rank {self.rank} output (tail)\n{self.output}"
        return text


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank, world_size, port, backend, environ, log_path, parent_pid, conn):
    """Entry point of one rank: join the group, report ready, serve pickled (fn, args) until told to stop."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(environ)
    os.environ.update(RANK=str(rank),
                      WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))

    def exit_when_orphaned():
        while os.getppid() == parent_pid:
            time.sleep(2.0)
        os._exit(70)

    threading.Thread(target=exit_when_orphaned, daemon=True).start()
    try:
        import torch
        import torch.distributed as dist
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend,
                                rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(minutes=10),
                                **kwargs)
        # Pay the communicator set-up here rather than inside the first call's timeout.
        probe = torch.ones(1, device=torch.device("cuda", rank) if backend == "nccl" else "cpu")
        dist.all_reduce(probe)
        if probe.item() != world_size:
            raise RuntimeError(f"all_reduce probe gave {probe.item()}, expected {world_size}")
    except BaseException:
        conn.send(("startup failed", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message[0] == "stop":
            break
        sys.stdout.flush()
        sys.stderr.flush()
        os.ftruncate(1, 0)  # fds 1 and 2 share the O_APPEND log: the call's output starts at offset 0
        try:
            fn, args = pickle.loads(message[1])
            torch.manual_seed(1234 + rank)
            reply = ("ok", fn(*args))
        except BaseException:
            reply = ("raised", traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(reply)
    try:
        dist.destroy_process_group()
    except Exception:  # exiting anyway; the parent kills a rank that does not
        pass


class RankGroup:
    """``world_size`` ranks on ``backend`` ("nccl": rank i uses GPU i; "gloo": CPU), started on first use.

    ``environ`` is added to each rank's environment (for instance ``DS_ACCELERATOR``).
    """

    def __init__(self, world_size: int, backend: str, environ=None):
        self.world_size = world_size
        self.backend = backend
        self.environ = dict(environ or {})
        self.procs = []
        self.conns = []
        self.logdir = tempfile.mkdtemp(prefix="ds-gpu-ranks-")
        self.starts = 0

    def _log(self, rank):
        return os.path.join(self.logdir, f"rank{rank}.log")

    def start(self) -> None:
        import torch.multiprocessing as mp
        if not any(os.path.abspath(p or os.curdir) == _REPO_ROOT for p in sys.path):
            sys.path.insert(0, _REPO_ROOT)  # the spawned ranks copy sys.path; they import tests.*
        ctx = mp.get_context("spawn")
        port = free_port()
        self.starts += 1
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            open(self._log(rank), "w").close()
            proc = ctx.Process(target=_rank_main,
                               daemon=True,
                               args=(rank, self.world_size, port, self.backend, self.environ, self._log(rank),
                                     os.getpid(), child_end))
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.kill()
                raise RuntimeError(f"rank {rank} did not start within {START_TIMEOUT_S:.0f}s:\n{self._tail(rank)}")
            try:
                status, detail = conn.recv()
            except (EOFError, OSError):
                status, detail = "died", f"exit code {self.procs[rank].exitcode}"
            if status != "ready":
                self.kill()
                raise RuntimeError(f"rank {rank} failed to start:\n{detail}\n{self._tail(rank)}")

    def call(self, fn: Callable, args: Sequence = (), timeout: float = 120.0, grace: float = GRACE_S) -> List[Outcome]:
        """Run the module-level ``fn(*args)`` on every rank; see the module docstring for what follows a failure."""
        if not self.procs:
            self.start()
        payload = pickle.dumps((fn, tuple(args)))
        for conn in self.conns:
            conn.send(("call", payload))
        outcomes = [None] * self.world_size
        deadline = time.monotonic() + timeout
        while any(o is None for o in outcomes):
            pending = {self.conns[r]: r for r in range(self.world_size) if outcomes[r] is None}
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = pending[conn]
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    self.procs[rank].join(timeout=5)
                    code = self.procs[rank].exitcode
                    outcomes[rank] = Outcome(rank, "died", detail=f"exit code {code}")
                    continue
                if status == "ok":
                    outcomes[rank] = Outcome(rank, "ok", value=value)
                else:
                    outcomes[rank] = Outcome(rank, status, detail=value)
                    deadline = min(deadline, time.monotonic() + grace)
        for rank, outcome in enumerate(outcomes):
            if outcome is None:
                outcomes[rank] = Outcome(rank,
                                         "no reply",
                                         detail=f"no answer within the time limit ({timeout:.0f}s "
                                         f"for the call, {grace:.0f}s after another rank failed)")
        if not all(o.ok for o in outcomes):
            for outcome in outcomes:
                outcome.output = self._tail(outcome.rank)
            self.kill()
        return outcomes

    def _tail(self, rank) -> str:
        try:
            with open(self._log(rank), errors="replace") as log:
                return log.read()[-OUTPUT_TAIL_CHARS:]
        except OSError:
            return ""

    def kill(self) -> None:
        """Kill every rank of this group (the processes this object started, by handle)."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=30)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def close(self) -> None:
        """Ask the ranks to exit; kill those that do not within a few seconds."""
        for conn in self.conns:
            try:
                conn.send(("stop", None))
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
        self.kill()
