# SPDX-License-Identifier: Apache-2.0
"""Host-memory pinning through a native page-locked allocator (upstream's ``DS_PIN_MEMORY_BACKEND=native``).

This runtime pins through torch only (``get_accelerator().pin_memory``). The native allocator needs upstream's
``pin_memory`` op, which is not built here: ``get_active_native_pinned_memory()`` returns None under the default
``DS_PIN_MEMORY_BACKEND=torch``, so callers use torch's pinning, and constructing :class:`NativePinnedMemory`
(which ``DS_PIN_MEMORY_BACKEND=native`` asks for) raises ``NotImplementedError``.
"""

import os

_shared_native_pins = None


class NativePinnedMemory:
    """Upstream's mlock-backed pinned-memory manager: not built here (see the module docstring)."""

    def __init__(self):
        raise NotImplementedError("native pinned memory (DS_PIN_MEMORY_BACKEND=native, upstream's pin_memory op) "
                                  "is not built in this runtime; leave DS_PIN_MEMORY_BACKEND unset to pin through "
                                  "torch; see docs/compatibility.md")

    def pin(self, tensor, make_copy=True, match_shape=True):
        raise NotImplementedError("NativePinnedMemory is not built in this runtime")

    def pin_empty(self, example, shape):
        raise NotImplementedError("NativePinnedMemory is not built in this runtime")

    def is_pinned(self, tensor):
        raise NotImplementedError("NativePinnedMemory is not built in this runtime")

    def unpin(self, tensor):
        raise NotImplementedError("NativePinnedMemory is not built in this runtime")


def get_native_pinned_memory():
    """The process-wide :class:`NativePinnedMemory` (raises here: the native allocator is not built)."""
    global _shared_native_pins
    if _shared_native_pins is None:
        _shared_native_pins = NativePinnedMemory()
    return _shared_native_pins


def get_active_native_pinned_memory():
    """The native manager when ``DS_PIN_MEMORY_BACKEND=native``, else None (pin through torch)."""
    if os.environ.get("DS_PIN_MEMORY_BACKEND", "torch").strip().lower() != "native":
        return None
    return get_native_pinned_memory()
