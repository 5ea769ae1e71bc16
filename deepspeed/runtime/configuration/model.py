# SPDX-License-Identifier: Apache-2.0
"""``DeepSpeedConfigModel``: upstream's pydantic base class for config sections, for code that subclasses it.

This runtime validates its own config with the dataclass sections of :mod:`config_utils` and does not need
pydantic; code written against upstream defines its own sections on this base (with pydantic's ``Field`` and
validators), so the class is pydantic's model and needs pydantic 2: the optional extra
``pip install 'deepspeed[pydantic]'`` installs it. The module is imported on first use of the name; without
pydantic 2 that use raises ``ModuleNotFoundError`` (an ``ImportError``) saying what to install.

The contract, as upstream's:

* ``Model(strict=False, **data)``: unless ``strict``, values equal to ``"auto"`` are dropped (the field keeps
  its default) so a framework's half-filled config still loads; unknown keys raise (``extra="forbid"``);
  fields are validated on assignment too; enums are stored as their values; a field may be set by its name
  or its alias.
* A field declared ``Field(..., json_schema_extra={"deprecated": True, "new_param": "a.b",
  "new_param_fn": fn, "set_new_param": True, "deprecated_msg": "..."})`` warns when given; if it names a
  ``new_param`` (a dotted path into nested sections) and ``set_new_param`` is not False, ``fn(value)`` is
  written there and the deprecated attribute is removed. Giving both the deprecated field and its
  replacement raises ``AssertionError``.
"""

from functools import reduce

import torch

# The extra that installs what this module needs (setup.py declares it).
PYDANTIC_EXTRA = "pydantic"

try:
    from pydantic import BaseModel, ConfigDict, field_serializer
except ImportError as error:  # absent, or pydantic 1 (no ConfigDict / field_serializer)
    raise ModuleNotFoundError(
        "deepspeed.runtime.config_utils.DeepSpeedConfigModel is upstream's base class of pydantic config sections "
        f"and needs pydantic 2, which deepspeed does not install by default: "
        f"pip install 'deepspeed[{PYDANTIC_EXTRA}]' (or pip install 'pydantic>=2'); import failed with "
        f"{type(error).__name__}: {error}",
        name="pydantic") from error

from deepspeed.utils.logging import logger  # noqa: E402


class DeepSpeedConfigModel(BaseModel):
    """See the module docstring."""

    model_config = ConfigDict(
        validate_default=True,
        validate_assignment=True,
        use_enum_values=True,
        populate_by_name=True,
        extra="forbid",
        arbitrary_types_allowed=True,
        protected_namespaces=(),
    )

    def __init__(self, strict=False, **data):
        if not strict:
            data = {key: value for key, value in data.items() if not (value == "auto" and key != "replace_method")}
        super().__init__(**data)
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated", False):
                self._apply_deprecated_field(name, extra)

    def _apply_deprecated_field(self, name, extra):
        if name not in self.model_fields_set:
            return
        new_param = extra.get("new_param", "")
        message = extra.get("deprecated_msg", "")
        logger.warning(f"Config parameter {name} is deprecated" + (f" use {new_param} instead" if new_param else "") +
                       (f". {message}" if message else ""))
        if not new_param or not extra.get("set_new_param", True):
            return
        value = extra.get("new_param_fn", lambda x: x)(getattr(self, name))
        delattr(self, name)
        *parents, leaf = new_param.split(".")
        target = reduce(getattr, parents, self)
        if leaf in target.model_fields_set:
            raise AssertionError(f"Cannot provide deprecated parameter '{name}' and replacing parameter "
                                 f"'{new_param}' together")
        setattr(target, leaf, value)

    @field_serializer("dtype", check_fields=False)
    def serialize_torch_dtype(dtype: torch.dtype) -> str:
        return str(dtype)
