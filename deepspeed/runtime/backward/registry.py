# SPDX-License-Identifier: Apache-2.0
"""Process-wide registry of backward sessions, keyed by autograd graph task.

One :class:`~deepspeed.runtime.backward.session.BackwardSession` exists per running
``backward()`` call (an autograd *graph task*). Every hook that takes part in a
backward asks :func:`session_for_current_task` for the session of the graph task it
runs in; the first one to ask opens it.

Nesting. A graph task started while another session is still open (reentrant
activation checkpointing runs ``torch.autograd.backward`` inside a backward node,
on the same autograd worker thread) *joins* the open session instead of opening
its own. Training runs one backward at a time per process, so "a session is open"
means "we are inside it". That is the one documented precondition: two user threads
must not run backward through DeepSpeed engines concurrently.

Suspension. Code that runs a backward of its own inside training, whose gradients are
not training gradients (Hessian-vector products for the eigenvalue monitor, a gradient
audit), runs it inside :func:`suspended`: no session opens there, so no engine sees it.

Stale sessions. If a backward raises, autograd drops its final callbacks, so the
epilogue never runs. Code that knows it is outside any backward (engine.forward,
zero_grad, step, the start of engine.backward) calls :func:`discard_stale_sessions`.
"""

import contextlib
import threading

import torch

_lock = threading.RLock()
_sessions = {}  # graph task id -> BackwardSession (nested ids alias their root)
_open = []  # root sessions whose epilogue has not run, oldest first
_suspended = 0  # depth of `suspended()` contexts


def current_graph_task_id():
    """The id of the graph task this thread is executing, or -1 outside backward."""
    return torch._C._current_graph_task_id()


def session_for_current_task():
    """Return the session of the running graph task, opening or joining one if needed.

    Must be called from inside a backward (a hook). Returns None outside backward,
    which happens only for hooks fired by direct node calls; callers then do nothing.
    """
    task = torch._C._current_graph_task_id()
    session = _sessions.get(task)
    if session is not None:
        return session
    if task < 0 or _suspended:
        return None
    from deepspeed.runtime.backward.session import BackwardSession
    with _lock:
        session = _sessions.get(task)
        if session is not None:
            return session
        if _open:
            session = _open[-1]
            session.join_nested(task)
        else:
            session = BackwardSession(task)
            _open.append(session)
            session.queue_epilogue()
        _sessions[task] = session
        return session


def close(session):
    """Forget ``session`` and every graph task that joined it. Idempotent."""
    with _lock:
        for task in session.task_ids:
            if _sessions.get(task) is session:
                del _sessions[task]
        if session in _open:
            _open.remove(session)


def discard_stale_sessions():
    """Unwind sessions left behind by a backward that raised.

    Only call this from code that is certainly outside any backward. Each stale
    session tells its engines to drop the half-done state of that backward.
    """
    if not _open or torch._C._current_graph_task_id() >= 0:
        return
    with _lock:
        stale = list(_open)
    for session in stale:
        session.abort()


@contextlib.contextmanager
def suspended():
    """Inside the context, backward passes open no session: engines neither see nor reduce them.

    Gradients computed there reach owned parameters as plain autograd leaves would
    (``torch.autograd.grad`` returns them; ``.backward()`` would leave them in ``.grad``).
    """
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


@contextlib.contextmanager
def explicit_session(seed):
    """A session that no autograd graph task opens: for gradients the engine computes with ``torch.autograd.grad``
    and hands over itself (``session.contribute_gradient``), with the factor ``seed`` gives. Its epilogue runs
    when the context exits; it is unwound if the context raises. Inside it no other session may be open."""
    from deepspeed.runtime.backward.session import BackwardSession
    if _open:
        raise RuntimeError("an explicit backward session cannot open inside another backward")
    session = BackwardSession(-1)
    with _lock:
        _open.append(session)
    try:
        session.add_seed(seed)
        yield session
    except BaseException:
        session.abort()
        raise
    session.close()


def open_sessions():
    """Sessions whose epilogue has not run (for tests and debugging)."""
    return list(_open)
