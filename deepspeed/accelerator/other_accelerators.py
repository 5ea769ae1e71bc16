# SPDX-License-Identifier: Apache-2.0
"""Upstream's other accelerators (Gaudi, Ascend, Apple MPS, Intel XPU, Cambricon MLU, Tecorigin SDAA, Biren
SUPA, Kunlunxin XPU): not built. Each ``<name>_accelerator`` module holds a ``DeepSpeedAccelerator`` subclass
under upstream's name that constructs anywhere, as upstream's does on a machine without its device, and
answers the probing questions code asks before choosing a device: ``is_available()`` is False,
``device_count()`` 0, ``device_name()`` and ``communication_backend_name()`` upstream's. Every method that would
use the device raises ``NotImplementedError`` naming it (this runtime runs on CUDA and the CPU;
``DS_ACCELERATOR`` accepts ``cuda`` and ``cpu``)."""

from .abstract_accelerator import DeepSpeedAccelerator


def _unavailable(class_name, device, method):

    def raise_not_built(self, *args, **kwargs):
        raise NotImplementedError(f"{class_name}.{method}: the {device} accelerator is not built in this runtime; "
                                  "it runs on CUDA and the CPU (DS_ACCELERATOR=cuda|cpu); see docs/compatibility.md")

    raise_not_built.__name__ = method
    return raise_not_built


def not_built_accelerator(class_name, device, module, name, backend):
    """A ``DeepSpeedAccelerator`` subclass called ``class_name`` for ``device``: its device type ``name`` and
    torch.distributed backend ``backend`` are upstream's; it is never available."""

    def __init__(self):
        DeepSpeedAccelerator.__init__(self)
        self._name = name
        self._communication_backend_name = backend
        self._compile_backend = "inductor"

    members = {method: _unavailable(class_name, device, method) for method in DeepSpeedAccelerator.__abstractmethods__}
    members.update({
        "__init__":
        __init__,
        "__module__":
        module,
        "__doc__":
        f"Upstream's {device} accelerator: not built here (never available).",
        "is_available":
        lambda self: False,
        "device_count":
        lambda self: 0,
        "device_name":
        lambda self, device_index=None: name if device_index is None else f"{name}:{device_index}",
    })
    return type(class_name, (DeepSpeedAccelerator, ), members)
