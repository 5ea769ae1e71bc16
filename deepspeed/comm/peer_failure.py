# SPDX-License-Identifier: Apache-2.0
"""A rank that leaves a training step through an exception: its peers fail in bounded time, with its reason.

The problem. Collectives pair up by order. When one rank raises inside ``engine.forward`` (say) while its peers
are already inside the step's gradient all-reduce, the peers wait for a partner that never comes: until the process
group's timeout (30 minutes by default), or for ever if the failed rank goes on and issues other collectives (which
pair with the wrong ones: a size mismatch aborts gloo, a silent one trains wrong). Upstream behaves the same.

The protocol. Every rank reaches the rendezvous store (the default group's ``Store``) without a collective.

1. When an exception leaves ``engine.forward``, ``engine.backward`` or ``engine.step`` (:func:`guarded`) on rank
   ``r`` of a group of several ranks, ``r`` writes a *fault record* (where, which exception, and how many
   collectives it has issued on each process group) under ``deepspeed/peer_failure/<fault number>/rank<r>``.
2. ``r`` waits for the other ranks' records of the same fault, at most :func:`failure_timeout` seconds. If every
   rank raised having issued the same collectives (a bad input that every rank rejects at the same point, as the
   runtime's own checks do), nothing is out of step: every rank goes on with its own exception, as before.
   Otherwise the fault is *abandoned*: ``r`` marks it so in the store, its process group is aborted, and its own
   exception goes on (with a note).
3. A peer blocked in a collective does not wait blindly: with gloo (CPU tensors) every wait of a ``deepspeed.comm``
   collective waits in slices of ``WATCH_SLICE_S`` and, between slices, reads the store (gloo's native
   reduce-scatter handle ignores a wait's timeout: a watched reduce-scatter runs as an all-reduce). Once the fault is
   abandoned, or a record shows that a rank left the step without issuing the collective the peer waits for, the
   peer marks the fault abandoned, aborts its group and raises :class:`PeerFailureError`, naming the rank, the call
   it left and its exception. A peer that raises because of the fault afterwards gets the same error.
4. The protocol never makes a failure surface later than the transport reports it. An exception whose chain holds
   the transport's report that a peer is gone (:data:`PEER_GONE`: the peer was killed, crashed, or exited after an
   exception outside the engine's methods) skips the wait of step 2: this rank marks the fault abandoned, aborts its
   group and raises :class:`PeerFailureError` at once, naming the peer and its exception if its record exists, else
   saying it ended without one (or that the store holding the records went with it). An exception that ends a
   process is published as its record before the exit closes the transport (:func:`record_uncaught_exceptions`),
   so that a peer names it. Under torchrun a rank also writes its error file (a PeerFailureError marks a peer's
   consequence), and the node agent reports the rank that failed on its own.

After that no process group exists on these ranks: ``init_distributed`` (and so ``deepspeed.initialize``) raises
:class:`PeerFailureError` at once, instead of waiting in a rendezvous no peer will join. A group cannot be mended
from inside the job (the peers' collectives are lost): the job is restarted (torchrun ``--max-restarts``, the
scheduler). A default group formed again by other means (``torch.distributed.init_process_group``) starts afresh.

Timeouts. The wait of step 2 is ``DS_PEER_FAILURE_TIMEOUT`` seconds (default 60, or :func:`set_failure_timeout`)
and never more than half the process group's timeout. The process group's timeout (``init_distributed(timeout=
...)``, default upstream's ``DEEPSPEED_TIMEOUT`` environment variable in minutes, else 30) bounds everything else:
a rank that hangs without raising (one that dies, the transport reports: step 4). ``KeyboardInterrupt`` and
``SystemExit`` abandon at once.

Limits. Only exceptions that leave ``engine.forward``, ``engine.backward`` or ``engine.step`` start the protocol
(wrap a direct ``loss.backward()`` or custom code in :func:`failure_guard`); only waits of ``deepspeed.comm``
collectives watch the store. NCCL waits do not block the host: there the peers end at the process group's timeout
(NCCL's watchdog), and a ``PeerFailureError`` is raised where the record is seen.
"""

import contextlib
import functools
import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

PREFIX = "deepspeed/peer_failure"
# What a transport says when the process at the other end of a connection is gone (gloo's TCP pairs, NCCL's remote
# error), lower-cased. Such an error is the transport's own, prompt report: nothing is left to wait for.
PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
             "ncclremoteerror")
DEFAULT_FAILURE_TIMEOUT_S = 60.0
WATCH_SLICE_S = 1.0
POLL_S = 0.02
ACK_WAIT_S = 5.0  # how long a failed rank keeps the store up for its peers to read the record
MAX_REASON_CHARS = 600
_RECORDED = "_deepspeed_fault_recorded"  # set on an exception the protocol has published


class PeerFailureError(RuntimeError):
    """A rank left a training step through an exception while this rank waited for it (or before this rank's own
    exception): the process group was aborted. ``failed`` maps each failed rank to its reason."""

    def __init__(self, message, failed=None):
        super().__init__(message)
        self.failed = dict(failed or {})


class _State:

    def __init__(self):
        self.fault = 0  # faults this rank went through with its peers (the same count on every rank): the key
        # namespace of the next one
        self.poisoned = None  # why this rank's group was aborted
        self.failed = {}
        self.timeout_s = None  # set_failure_timeout
        self.pg_timeout = None  # the timeout init_distributed gave the group
        self.watch_world = None  # id() of the default group ``watch`` was decided for, and the decision
        self.watch = False
        self.watch_forced = None  # set_watched_waits
        self.excepthook_installed = False  # record_uncaught_exceptions
        self.local = threading.local()


_state = _State()


# ------------------------------------------------------------------------------------------------ settings
def set_failure_timeout(seconds):
    """Seconds a rank that raised waits for its peers to raise alike before the fault is abandoned (None: back to
    ``DS_PEER_FAILURE_TIMEOUT`` or 60 s)."""
    if seconds is not None and not float(seconds) > 0:
        raise ValueError(f"set_failure_timeout: seconds must be positive, got {seconds!r}")
    _state.timeout_s = None if seconds is None else float(seconds)


def record_group_timeout(timeout):
    """``init_distributed`` tells the timeout it created the default group with (a ``timedelta``)."""
    _state.pg_timeout = timeout


def _group_timeout():
    """The default group's collective timeout, as its backend reports it (else as ``init_distributed`` made it)."""
    try:
        import torch
        group = dist.distributed_c10d._get_default_group()
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # another backend or torch version: what init_distributed was given, if anything
        return _state.pg_timeout


def failure_timeout():
    """Seconds a rank that raised waits for its peers (see the module docstring)."""
    seconds = _state.timeout_s
    if seconds is None:
        raw = os.environ.get("DS_PEER_FAILURE_TIMEOUT")
        try:
            seconds = float(raw) if raw else DEFAULT_FAILURE_TIMEOUT_S
        except ValueError:
            raise ValueError(f"DS_PEER_FAILURE_TIMEOUT must be a number of seconds, got {raw!r}") from None
    group_timeout = _group_timeout()
    if isinstance(group_timeout, timedelta):
        seconds = min(seconds, group_timeout.total_seconds() / 2)
    return max(seconds, POLL_S)


def check_usable():
    """Raise :class:`PeerFailureError` if this rank aborted its process group after a fault and no new one exists
    (``init_distributed`` calls it first, so a retry gets the reason instead of a rendezvous nobody joins)."""
    if _state.poisoned is None:
        return
    if dist.is_available() and dist.is_initialized():  # someone formed a new group: a fresh start
        _clear()
        return
    raise PeerFailureError(
        f"{_state.poisoned}\nThis process's process group was aborted and cannot be formed again from inside the "
        f"job (its peers lost their collectives): restart the job on every rank (see docs/faults.md).", _state.failed)


def _clear():
    # ``fault`` keeps counting: a group formed again inside this process may share the old rendezvous store (a
    # multi-tenant TCPStore keeps its keys), and every rank that went through the fault counted it
    _state.poisoned = None
    _state.failed = {}


# ------------------------------------------------------------------------------------------------ the guard
def guarded(where):
    """Decorate an engine method (``where``: its name in messages) so that an exception leaving it runs the fault
    protocol of the module docstring. Nested guarded calls leave it to the outermost one."""

    def decorate(method):

        @functools.wraps(method)
        def call(self, *args, **kwargs):
            local = _state.local
            if getattr(local, "active", False):
                return method(self, *args, **kwargs)
            local.active = True
            try:
                return method(self, *args, **kwargs)
            except BaseException as exc:
                step = getattr(self, "global_steps", None)
                on_exception(exc, where if step is None else f"{where} (global step {step})")
                raise
            finally:
                local.active = False

        return call

    return decorate


@contextlib.contextmanager
def failure_guard(where="training step"):
    """The protocol of :func:`guarded` around any block (a direct ``loss.backward()``, custom collectives)."""
    local = _state.local
    if getattr(local, "active", False):
        yield
        return
    local.active = True
    try:
        yield
    except BaseException as exc:
        on_exception(exc, where)
        raise
    finally:
        local.active = False


# ------------------------------------------------------------------------------------------------ the store
def _peers():
    """(store, rank, world) of the default group, or None when there are no peers to tell."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _state.poisoned is not None:  # a new group was formed since ours was aborted
        _clear()
    world = dist.get_world_size()
    if world < 2:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    return store, dist.get_rank(), world


def _group_key(group):
    return getattr(group, "group_name", None) or str(id(group))


def _sequences():
    """Collectives issued so far on each process group of this rank (group name -> count)."""
    out = {}
    try:
        for group in list(dist.distributed_c10d._world.pg_map):
            try:
                out[_group_key(group)] = int(group._get_sequence_number_for_group())
            except (AttributeError, RuntimeError):
                pass
    except (AttributeError, RuntimeError):
        pass
    return out


def _get(store, key):
    return store.get(key).decode("utf-8", "replace") if store.check([key]) else None


def _base():
    return f"{PREFIX}/{_state.fault}"


def _records(store, world, base):
    """rank -> its fault record (dict with ``seq`` and ``reason``) of this fault."""
    found = {}
    for q in range(world):
        raw = _get(store, f"{base}/rank{q}")
        if raw is not None:
            found[q] = json.loads(raw)
    return found


def _in_step(records):
    """Whether every group's collective count agrees among the ranks that hold the group.

    A rank holds only the groups it is a member of (a one-rank group of the mesh, made by its rank alone, exists on
    that rank only), so counts are compared group by group among the records that name it, never as whole maps.
    """
    seen = {}
    for record in records.values():
        for group, count in record["seq"].items():
            if seen.setdefault(group, count) != count:
                return False
    return True


def _describe(records):
    return "; ".join(f"rank {q} {record['reason']}" for q, record in sorted(records.items()))


def _reason(exc, where):
    text = f"{type(exc).__name__}: {exc}".strip()
    if len(text) > MAX_REASON_CHARS:
        text = text[:MAX_REASON_CHARS] + " ..."
    return f"left {where} with {text}"


def _note(exc, text):
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(text)


# ------------------------------------------------------------------------------------------------ faults
def on_exception(exc, where):
    """Run the fault protocol for ``exc`` leaving ``where`` on this rank. Raises :class:`PeerFailureError` (from
    ``exc``) when a peer's fault explains it; otherwise returns, and the caller re-raises ``exc``."""
    if isinstance(exc, PeerFailureError):
        return
    peers = _peers()
    if peers is None:
        return
    try:
        setattr(exc, _RECORDED, True)  # an uncaught exception publishes no second record (record_uncaught_exceptions)
    except AttributeError:
        pass
    store, rank, world = peers
    base = _base()
    try:
        if store.check([f"{base}/abandoned"]):  # a peer gave up on this fault: that is why this rank failed
            _peer_failed(store, rank, world, exc, where)
        if _transport_lost_peer(exc) is not None:  # a peer is gone: its record, if any, is there already
            _peer_gone(store, rank, world, exc, where)
        store.set(f"{base}/rank{rank}", json.dumps(dict(seq=_sequences(), reason=_reason(exc, where))))
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            _abandon(store, rank, world, exc)
            return
        keys = [f"{base}/rank{q}" for q in range(world)]
        deadline = time.monotonic() + failure_timeout()
        while True:
            if store.check(keys):
                records = _records(store, world, base)
                if _in_step(records):
                    _state.fault += 1  # every rank left at the same point: nothing is out of step
                    return
                _abandon(store, rank, world, exc)
                return
            if store.check([f"{base}/abandoned"]) or time.monotonic() >= deadline:
                _abandon(store, rank, world, exc)
                return
            time.sleep(POLL_S)
    except PeerFailureError:
        raise
    except Exception as store_error:  # the store is gone (the process holding it ended): say so, keep exc
        _abort_group()
        _state.poisoned = (f"Training stopped: rank {rank} {_reason(exc, where)}; the rendezvous store could not be "
                           f"reached ({type(store_error).__name__}: {store_error})")
        if _transport_lost_peer(exc) is not None:  # a peer is gone, and with it the store it held: say so now
            _store_gone(rank, world, exc, where, store_error)
        _note(exc, f"[deepspeed] {_state.poisoned}; the process group was aborted (docs/faults.md)")


def _abandon(store, rank, world, exc):
    """This rank gives up on the fault it is part of: mark it abandoned, abort the group, keep the store up until
    the peers read the records (or a few seconds)."""
    base = _base()
    records = _records(store, world, base)
    store.compare_set(f"{base}/abandoned", "", _describe(records))
    _abort_group()
    waiting = [f"{base}/ack{q}" for q in range(world) if q not in records]
    deadline = time.monotonic() + min(ACK_WAIT_S, failure_timeout())
    while waiting and time.monotonic() < deadline and not store.check(waiting):
        time.sleep(POLL_S)
    _state.failed = {q: r["reason"] for q, r in records.items()}
    _state.poisoned = f"Training stopped on every rank: {_describe(records)}."
    _state.fault += 1
    _note(
        exc, "[deepspeed] the ranks did not leave the step at the same point: the process group was aborted and the "
        "peers were told, so that they fail now instead of waiting (docs/faults.md)")


def _peer_failed(store, rank, world, cause, where):
    """A peer left the step: mark the fault abandoned, abort this rank's group, raise PeerFailureError."""
    base = _base()
    records = _records(store, world, base)
    records.pop(rank, None)
    store.compare_set(f"{base}/abandoned", "", _describe(records))
    store.set(f"{base}/ack{rank}", "1")
    _abort_group()
    failed = {q: r["reason"] for q, r in records.items()}
    _state.failed = failed
    described = _describe(records) or "a peer's fault (no record)"
    _state.poisoned = f"Training stopped on every rank: {described}."
    _state.fault += 1
    message = (f"rank {rank}: {where} could not complete: {described}. The process group was aborted on every "
               f"rank; restart the job (see docs/faults.md). This rank's own error: "
               f"{type(cause).__name__}: {str(cause)[:200]}")
    _mark_consequence(message)
    raise PeerFailureError(message, failed) from cause


def _write_error_file(text):
    """Under torchrun, write this worker's error file as torchrun's ``record`` decorator writes it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": text, "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))}}}
    # Written aside and renamed into place: the agent stops the other workers as soon as one fails and then reads
    # every error file, so a file it finds must never be half written.
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as handle:
            json.dump(data, handle)
        os.replace(partial, path)
    except OSError:  # best effort: the agent then orders failures by time alone
        pass


def _mark_consequence(message):
    """The error file says this rank fails because of a peer: the node agent then reports the rank whose failure
    caused it, not this one (``deepspeed/launcher/launch.py``)."""
    _write_error_file(f"{PeerFailureError.__name__}: {message}")


def record_uncaught_exceptions():
    """Make an exception that ends this process known before the interpreter's exit (which closes the transport and
    can take seconds): its fault record goes to the rendezvous store, so that a peer names it (step 4 of the module
    docstring), unless the exception already went through the protocol or was caused by a peer; under torchrun it
    also goes to the worker's error file (as torchrun's ``record`` decorator would write it), so that the node agent
    knows which rank ended on its own exception even when it stops that rank before it exits. Installed once, by
    ``init_distributed``; the previous ``sys.excepthook`` runs after."""
    if _state.excepthook_installed:
        return
    _state.excepthook_installed = True
    previous = sys.excepthook

    def hook(kind, value, traceback):
        try:
            _record_uncaught(kind, value)
        except Exception:  # never in the way of the traceback
            pass
        previous(kind, value, traceback)

    sys.excepthook = hook


def _record_uncaught(kind, value):
    cause = value
    while cause is not None and not isinstance(cause, PeerFailureError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        _mark_consequence(str(cause))
        return
    text = f"{kind.__name__}: {value}".strip()
    _write_error_file(text)
    peers = _peers()
    if peers is None or getattr(value, _RECORDED, False):
        return
    store, rank, world = peers
    if len(text) > MAX_REASON_CHARS:
        text = text[:MAX_REASON_CHARS] + " ..."
    store.set(f"{_base()}/rank{rank}", json.dumps(dict(seq=_sequences(), reason=f"ended with an uncaught {text}")))


def _transport_lost_peer(exc):
    """The exception in ``exc``'s chain by which the transport reports a peer gone (:data:`PEER_GONE`), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).lower()
        if any(words in text for words in PEER_GONE):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _peer_gone(store, rank, world, cause, where):
    """The transport reports a peer gone: end now (never later than the transport), naming the ranks that left a
    record and their errors, and those that left none. Raises PeerFailureError."""
    base = _base()
    records = _records(store, world, base)
    records.pop(rank, None)
    silent = [q for q in range(world) if q != rank and q not in records]
    parts = [_describe(records)] if records else []
    if silent:
        who = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {', '.join(map(str, silent))}"
        parts.append(f"{who} ended without a failure record" if world == 2 else f"{who} left no failure record")
    described = "; ".join(parts)
    store.compare_set(f"{base}/abandoned", "", described)  # peers still waiting fail at once too
    store.set(f"{base}/ack{rank}", "1")
    _abort_group()
    failed = {q: r["reason"] for q, r in records.items()}
    if world == 2 and silent:
        failed[silent[0]] = "ended without a failure record"
    _state.failed = failed
    _state.poisoned = f"Training stopped on every rank: {described}."
    _state.fault += 1
    transport = str(_transport_lost_peer(cause)).strip().splitlines()[0][:300]
    message = (f"rank {rank}: {where} could not complete: {described}. The transport reported the peer gone "
               f"({transport}). The process group was aborted on every rank; restart the job (see docs/faults.md).")
    _mark_consequence(message)
    raise PeerFailureError(message, failed) from cause


def _store_gone(rank, world, cause, where, store_error):
    """The transport reports a peer gone and the store that would hold its record is unreachable (the peer held
    it: rank 0 without the launcher). Raises PeerFailureError."""
    failed = {1 - rank: "ended; no failure record could be read (the store it held is gone)"} if world == 2 else {}
    _state.failed = failed
    transport = str(_transport_lost_peer(cause)).strip().splitlines()[0][:300]
    who = f"rank {1 - rank} ended" if world == 2 else "a peer ended"
    message = (f"rank {rank}: {where} could not complete: {who}, and the rendezvous store could not be reached to "
               f"read a failure record ({type(store_error).__name__}: {str(store_error)[:200]}). The transport "
               f"reported the peer gone ({transport}). The process group was aborted; restart the job (see "
               f"docs/faults.md).")
    _mark_consequence(message)
    raise PeerFailureError(message, failed) from cause


def _abort_group():
    """End this rank's default process group now, without waiting for its pending work."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort()
        else:
            dist.destroy_process_group()
    except Exception:  # already broken: nothing more to end
        pass


# ------------------------------------------------------------------------------------------------ watched waits
def set_watched_waits(enabled):
    """Force watched waits on or off (None: automatic, on for a default group of several gloo ranks unless
    ``DS_PEER_FAILURE_WATCH=0``). Off keeps gloo's native reduce-scatter, and peers then wait for the group's
    timeout."""
    _state.watch_forced = None if enabled is None else bool(enabled)


def watching():
    """Whether ``deepspeed.comm`` collectives wait in watched slices (see :func:`set_watched_waits`)."""
    if _state.watch_forced is not None:
        return _state.watch_forced and dist.is_initialized()
    world = getattr(dist.distributed_c10d.GroupMember, "WORLD", None)
    key = id(world)  # not the group itself: a reference here would keep a destroyed group's threads alive
    if key != _state.watch_world:
        _state.watch_world = key
        try:
            _state.watch = (world is not None and os.environ.get("DS_PEER_FAILURE_WATCH", "1") != "0"
                            and dist.get_world_size() > 1 and dist.get_backend() == "gloo")
        except (RuntimeError, ValueError):
            _state.watch = False
    return _state.watch


def call_watched(fn, args, kwargs, async_at, group_at):
    """Run collective ``fn`` asynchronously and return a :class:`WatchedWork` (or wait on it, for a synchronous
    call). ``async_at`` / ``group_at``: the positions of its ``async_op`` and ``group`` parameters (or None)."""
    if async_at is None:
        return fn(*args, **kwargs)
    if len(args) > async_at:
        wanted = bool(args[async_at])
        args = args[:async_at] + (True, ) + args[async_at + 1:]
    else:
        wanted = bool(kwargs.get("async_op", False))
        kwargs["async_op"] = True
    group = args[group_at] if group_at is not None and len(args) > group_at else kwargs.get("group")
    work = fn(*args, **kwargs)
    if work is None:
        return None
    watched = WatchedWork(work, group)
    if wanted:
        return watched
    watched.wait()
    return None


class WatchedWork:
    """A work handle whose ``wait()`` reads the rendezvous store between slices (see the module docstring); every
    other attribute is the wrapped handle's."""

    __slots__ = ("_work", "_group", "_seq")

    def __init__(self, work, group):
        self._work = work
        self._group = group
        try:
            pg = group if group is not None else dist.distributed_c10d._get_default_group()
            self._seq = (_group_key(pg), int(pg._get_sequence_number_for_group()))
        except (AttributeError, RuntimeError, ValueError):
            self._seq = None

    def wait(self, timeout=None):
        if timeout is not None:
            return self._work.wait(timeout)
        _wait_watched(self._work, self._seq)
        return True

    def synchronize(self):
        self.wait()

    def __getattr__(self, name):
        return getattr(self._work, name)


def _wait_watched(work, seq):
    inner = getattr(work, "_works", None)
    if isinstance(inner, list):  # the fallbacks' ChainedWork: watch its collectives, then finish it
        for part in list(inner):
            _wait_watched(part, seq)
        work.wait()
        return
    step = timedelta(seconds=WATCH_SLICE_S)
    while True:
        try:
            work.wait(step)
            return
        except RuntimeError as exc:
            if "timed out" not in str(exc):
                raise
            _check_while_blocked(seq, exc)


def _check_while_blocked(seq, cause):
    """Between two slices of a blocked wait: raise PeerFailureError if the fault is abandoned, or if a rank left the
    step without issuing the collective this rank waits for."""
    peers = _peers()
    if peers is None:
        return
    store, rank, world = peers
    base = _base()
    try:
        if store.check([f"{base}/abandoned"]):
            _peer_failed(store, rank, world, cause, "a collective")
        if seq is None:
            return
        name, mine = seq
        for q in range(world):
            if q == rank or not store.check([f"{base}/rank{q}"]):
                continue
            record = json.loads(_get(store, f"{base}/rank{q}"))
            theirs = record["seq"].get(name)
            if theirs is not None and theirs < mine:  # it left before issuing this collective: it never will
                _peer_failed(store, rank, world, cause, "a collective")
    except PeerFailureError:
        raise
    except Exception:  # the store is unreachable: keep waiting; the group's timeout bounds the wait
        return
