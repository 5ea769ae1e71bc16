# SPDX-License-Identifier: Apache-2.0
"""Named profiler ranges for the phases of the gradient pipeline and the step (``DS::<phase>``).

``ds_range(name)`` is ``torch.profiler.record_function(name)`` while a profiler is
recording and a no-op context otherwise, so the hot path pays one flag check per range
when nobody profiles.
"""

import contextlib

import torch

_NULL = contextlib.nullcontext()


def ds_range(name):
    """A ``record_function`` range named ``name`` when the profiler is on; a no-op context otherwise."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _NULL
