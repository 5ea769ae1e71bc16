# SPDX-License-Identifier: Apache-2.0
"""Upstream's other accelerators (Gaudi, Ascend, Apple MPS, Intel XPU, Cambricon MLU, Tecorigin SDAA, Biren
SUPA, Kunlunxin XPU): not built. Each ``<name>_accelerator`` module imports and holds a
``DeepSpeedAccelerator`` subclass under upstream's name; constructing it raises ``NotImplementedError``
naming the device (this runtime runs on CUDA and the CPU; ``DS_ACCELERATOR`` accepts ``cuda`` and ``cpu``)."""

from .abstract_accelerator import DeepSpeedAccelerator


def not_built_accelerator(class_name, device, module):
    """A ``DeepSpeedAccelerator`` subclass called ``class_name`` that cannot be constructed."""

    def __new__(cls, *args, **kwargs):
        raise NotImplementedError(f"the {device} accelerator ({class_name}) is not built in this runtime; it runs on "
                                  f"CUDA and the CPU (DS_ACCELERATOR=cuda|cpu); see docs/compatibility.md")

    return type(class_name, (DeepSpeedAccelerator, ), {
        "__new__": __new__,
        "__module__": module,
        "__doc__": f"Upstream's {device} accelerator: not built here.",
    })
