# SPDX-License-Identifier: Apache-2.0
"""The default process group's lifetime: nothing pins it, and it is gone before the interpreter shuts down.

Why this exists. A gloo process group owns native worker threads (``pt_gloo_runloop``). When a worker
finishes a collective it drops its reference to the work object, and with it to the tensors of the
collective; a tensor that Python has seen needs the GIL for that last release. If the interpreter is
already finalizing, taking the GIL ends the thread with ``pthread_exit``, which unwinds through a
``noexcept`` C++ destructor: ``std::terminate`` -- "terminate called without an active exception" and
exit code 134 -- although training finished and every result was written. The worker is only slow (a
loaded machine), so the crash strikes some runs and not others.

Two things keep the worker threads alive into finalization, and this module removes both:

* a process group that ``destroy_process_group()`` cannot free. ``torch.distributed.nn.functional``
  declares ``group=group.WORLD`` as a default argument of ten functions; imported after the default group
  exists (``torch.optim`` imports ``torch._dynamo`` on first use, which imports it), those defaults hold
  the group forever. :func:`import_group_pinning_modules` imports it while no group exists, so the
  defaults are ``None``; ``deepspeed.comm`` calls it when it is imported.
* a script that never calls ``destroy_process_group()`` (most do not). :func:`destroy_at_exit` registers
  an ``atexit`` hook that destroys the default group while the interpreter is still whole: destroying it
  joins its worker threads, which may still take the GIL to finish their last work.
"""

import atexit

import torch.distributed as dist

_exit_hook_registered = False
_world_teardown_hooks = []


def import_group_pinning_modules():
    """Import, before any process group exists, the torch modules that capture ``group.WORLD`` at import.

    Returns whether the import happened while no default group existed (the case where it helps).
    """
    no_group_yet = not (dist.is_available() and dist.is_initialized())
    try:
        import torch.distributed.nn.functional  # noqa: F401
    except ImportError:  # a torch build without distributed support has nothing to pin
        pass
    return no_group_yet


def destroy_at_exit():
    """Destroy the default process group at interpreter exit if it still exists then. Idempotent."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_destroy_default_group)
        _exit_hook_registered = True


def _destroy_default_group():
    # atexit hooks run before finalization, when worker threads can still take the GIL.
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def on_world_destroyed(hook):
    """Register ``hook()`` to run when ``deepspeed.comm.destroy_process_group()`` destroys the default group,
    before the group goes. Modules that keep references to groups (the mesh) register here, so that dropping those
    references needs no import from ``deepspeed.comm`` back into them. Idempotent per hook."""
    if hook not in _world_teardown_hooks:
        _world_teardown_hooks.append(hook)


def run_world_teardown_hooks():
    """Call every hook registered with :func:`on_world_destroyed`, in registration order."""
    for hook in list(_world_teardown_hooks):
        hook()
