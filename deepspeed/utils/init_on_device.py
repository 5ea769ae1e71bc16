# SPDX-License-Identifier: Apache-2.0
"""``OnDevice``: build a module's tensors directly on a device (``"meta"`` for shapes only) and in a dtype.

Inside ``with OnDevice(dtype=torch.bfloat16, device="meta"):`` every tensor created without an explicit
``device`` lands on ``device``, and every floating-point tensor created without an explicit ``dtype`` has
``dtype``; integer and boolean tensors keep their types. Both are torch's own defaults (the device context and
the default dtype), set on entry and restored on exit, so nothing is patched. ``enabled=False`` makes the
context a no-op.
"""

import torch


class OnDevice:
    """See the module docstring."""

    def __init__(self, dtype, device="meta", enabled=True):
        self.dtype = dtype
        self.device = device
        self.enabled = enabled
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"OnDevice(dtype=...) must be a floating-point dtype, got {dtype}")
        self._device_context = None
        self._saved_dtype = None

    def __enter__(self):
        if not self.enabled:
            return self
        self._saved_dtype = torch.get_default_dtype()
        if self.dtype is not None:
            torch.set_default_dtype(self.dtype)
        self._device_context = torch.device(self.device)
        self._device_context.__enter__()
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        if not self.enabled:
            return False
        try:
            self._device_context.__exit__(exc_type, exc_value, traceback)
        finally:
            torch.set_default_dtype(self._saved_dtype)
            self._device_context = None
        return False
