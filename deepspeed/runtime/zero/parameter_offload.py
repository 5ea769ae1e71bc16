# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``deepspeed.runtime.zero.parameter_offload``: the ZeRO-3 module-hook manager and the parameter dict
that gathers on access.

Upstream's ``DeepSpeedZeRoOffload`` installs the forward/backward hooks that gather and release a ZeRO-3
model's parameters, and is what ``engine.optimizer`` is on stage 3 without an optimizer. Here that job is
done by the stage's ``UnitCoordinator`` (``parameter_units.py``), built by ``deepspeed.initialize``; an engine
without an optimizer has ``engine.optimizer = None``. Constructing ``DeepSpeedZeRoOffload`` directly is not
built and raises ``NotImplementedError``.

:class:`ZeROOrderedDict` is what a ZeRO-3 module's ``_parameters`` is (upstream's class): reading a released
parameter from it inside a forward hands the parameter to the coordinator, which registers it as an external
parameter of the module running and gathers it (a forward that uses another module's weight, ``F.linear(x,
self.other.weight)``, works without ``register_external_parameter``). :func:`ensure_zero_ordered_dict` converts a
module's dict (the coordinator does so for every module when it installs its hooks, and at each forward for
modules attached since); :func:`restore_parameters_dict` undoes it.

``partitioned_param_data_shape`` is the shape of a released parameter's ``.data`` (``[0]``).
"""

from collections import OrderedDict

from deepspeed.runtime.zero.partition_parameters import (  # noqa: F401
    DEFAULT_TENSOR_OVERRIDES, DeepSpeedTensorOverride, ZeroParamStatus, partitioned_param_data_shape)

FWD_MODULE_STACK = []


class ZeROOrderedDict(OrderedDict):
    """A module's parameter dict under ZeRO-3: reading a released parameter during a forward gathers it (see the
    module docstring). ``parent_module`` is the module it belongs to; ``coordinator`` the ``UnitCoordinator`` that
    gathers (None: a plain dict)."""

    def __init__(self, parent_module=None, *args, coordinator=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._parent_module = parent_module
        self._coordinator = coordinator
        self._in_forward = False  # upstream's attribute; the coordinator keeps the forward state itself

    def __getitem__(self, key):
        param = super().__getitem__(key)
        if (self._coordinator is not None and param is not None
                and getattr(param, "ds_status", None) is ZeroParamStatus.NOT_AVAILABLE):
            self._coordinator.gather_on_access(param)
        return param

    def __reduce__(self):
        # a copy (copy.deepcopy of the model) is a dict of the same class that gathers through nobody
        return (type(self), (self._parent_module, ), None, None, iter(OrderedDict.items(self)))


def ensure_zero_ordered_dict(module, coordinator=None):
    """Make ``module._parameters`` a :class:`ZeROOrderedDict` with the same entries (the first dict replaced is kept
    as ``module._original_parameters``); one already converted only takes ``coordinator`` (if given). Nothing
    happens to an object without a parameter dict."""
    params = getattr(module, "_parameters", None)
    if params is None:
        return
    if isinstance(params, ZeROOrderedDict):
        if coordinator is not None:
            params._coordinator = coordinator
        return
    if not hasattr(module, "_original_parameters"):
        module._original_parameters = params
    module._parameters = ZeROOrderedDict(module, params, coordinator=coordinator)


def restore_parameters_dict(module):
    """Undo :func:`ensure_zero_ordered_dict`: a plain dict with the current entries."""
    params = getattr(module, "_parameters", None)
    if isinstance(params, ZeROOrderedDict):
        module._parameters = dict(OrderedDict.items(params))
        if hasattr(module, "_original_parameters"):
            del module._original_parameters


class DeepSpeedZeRoOffload:
    """Upstream's ZeRO-3 hook manager: not built as a standalone object (see the module docstring)."""

    def __init__(self, module, timers, ds_config, *args, **kwargs):
        raise NotImplementedError("DeepSpeedZeRoOffload (upstream's ZeRO-3 hook manager) is not built as a standalone "
                                  "object in this runtime: deepspeed.initialize with zero_optimization.stage 3 "
                                  "installs the equivalent hooks; see docs/compatibility.md")
