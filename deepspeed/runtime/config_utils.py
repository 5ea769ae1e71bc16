# SPDX-License-Identifier: Apache-2.0
"""Building blocks of config validation: the error type, loading, value parsers and typed sections.

A config section is a frozen dataclass whose fields are declared with :func:`config_field`. Each field
names a *parser*, a callable ``parse(value, path) -> value`` that checks the user's value and returns
the normalised one, or raises :class:`DeepSpeedConfigError` with the full key path (for example
``zero_optimization.offload_optimizer.device``) and what would have been accepted.
:meth:`ConfigSection.from_dict` applies the parsers, rejects keys that are not fields (or their
aliases), and hands the values to the section's ``_finalize`` hook for rules that span several keys.

Everything here is pure and local: no collectives, so every rank raises the same error.
"""

import base64
import binascii
import copy
import dataclasses
import json
import logging
import math
import os
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

from .constants import AUTO, AUTO_ALLOWED_PATHS

# A child of upstream's "DeepSpeed" logger, so its handlers and level apply.
logger = logging.getLogger("DeepSpeed.config")


class DeepSpeedConfigError(ValueError):
    """An invalid DeepSpeed config. The message names the full key path and the accepted values."""


def _describe(value) -> str:
    return f"{value!r} ({type(value).__name__})"


#########################################
# Loading
#########################################


def _reject_duplicate_keys(pairs):
    """``json`` object hook: a key given twice in one object is an error, not a silent override."""
    result = {}
    for key, value in pairs:
        if key in result:
            raise DeepSpeedConfigError(f"config has duplicate key '{key}'")
        result[key] = value
    return result


def _parse_json_text(text: str, source: str) -> dict:
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as err:
        raise DeepSpeedConfigError(f"config {source} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise DeepSpeedConfigError(f"config {source} must hold a JSON object at the top level, got "
                                   f"{type(data).__name__}")
    return data


def load_config(config) -> dict:
    """Return the config as a fresh ``dict``.

    ``config`` is a dict (deep-copied, so later edits by the caller do not leak in), or a ``str`` /
    ``os.PathLike`` path to a JSON file. A string that names no file is tried as url-safe base64 of a
    JSON object, which is how the launcher can pass a config on the command line. Anything else raises
    ``TypeError``; an unreadable, malformed or duplicate-key file raises :class:`DeepSpeedConfigError`.
    """
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"DeepSpeed config must be a dict or a path to a JSON file, got {type(config).__name__}")
    path = os.fspath(config)
    if os.path.isfile(path):
        with open(path, "r", encoding="utf-8") as handle:
            return _parse_json_text(handle.read(), f"file '{path}'")
    if isinstance(config, str):
        try:
            decoded = base64.urlsafe_b64decode(config.encode("ascii")).decode("utf-8")
        except (binascii.Error, UnicodeError, ValueError):
            decoded = None
        if decoded is not None and decoded.lstrip().startswith("{"):
            return _parse_json_text(decoded, "passed as base64")
    raise DeepSpeedConfigError(f"config path '{path}' does not exist (expected a dict, a JSON file path, or "
                               "base64-encoded JSON)")


def find_auto_values(value, path: str = "") -> Optional[str]:
    """Return the path of the first ``"auto"`` string in ``value`` (depth-first, in key order), else None.

    Frameworks (HF Accelerate, Transformers) write ``"auto"`` for values they fill in themselves; one
    that reaches the runtime was never filled. Paths in ``AUTO_ALLOWED_PATHS`` are skipped: upstream
    gives ``"auto"`` a meaning there.
    """
    if isinstance(value, str):
        if value.strip().lower() == AUTO and path not in AUTO_ALLOWED_PATHS:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = find_auto_values(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = find_auto_values(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


# Sections upstream parses with models that drop an exact ``"auto"`` value, leaving the key's default (OpenRLHF
# and others pass such configs to deepspeed.initialize as they are). ZenFlow's "auto" keys mean something else.
AUTO_MEANS_DEFAULT = ("zero_optimization", )
_AUTO_KEEPS_MEANING = ("zenflow", )


def drop_default_autos(param_dict: dict) -> dict:
    """``param_dict`` with every exact ``"auto"`` value in the sections of :data:`AUTO_MEANS_DEFAULT` (and their
    sub-sections) removed, as upstream's config models remove them: the key takes its default. The dict given
    is not changed."""

    def strip(section):
        out = {}
        for key, value in section.items():
            if value == AUTO:
                continue
            out[key] = strip(value) if isinstance(value, dict) and key not in _AUTO_KEEPS_MEANING else value
        return out

    if not any(isinstance(param_dict.get(name), dict) for name in AUTO_MEANS_DEFAULT):
        return param_dict
    stripped = dict(param_dict)
    for name in AUTO_MEANS_DEFAULT:
        if isinstance(param_dict.get(name), dict):
            stripped[name] = strip(param_dict[name])
    return stripped


def raise_on_auto_values(param_dict: dict) -> None:
    """Raise :class:`DeepSpeedConfigError` naming the first unresolved ``"auto"`` value, if any."""
    path = find_auto_values(param_dict)
    if path is not None:
        raise DeepSpeedConfigError(
            f"config key '{path}' is 'auto': DeepSpeed does not resolve 'auto' values itself; it must be "
            "replaced by a concrete value before deepspeed.initialize (HF Accelerate/Transformers fill these in)")


#########################################
# Value parsers: parse(value, path) -> normalised value
#########################################

Parser = Callable[[Any, str], Any]


def boolean() -> Parser:
    """Only ``True``/``False``: strings and integers are rejected rather than guessed at."""

    def parse(value, path):
        if not isinstance(value, bool):
            raise DeepSpeedConfigError(f"config key '{path}' must be a bool (true or false), got {_describe(value)}")
        return value

    return parse


def integer(minimum: Optional[int] = None,
            maximum: Optional[int] = None,
            choices: Optional[Iterable] = None) -> Parser:
    """An int; a float with no fractional part (``5e8``) is converted. Bools are rejected."""
    allowed = tuple(choices) if choices is not None else None

    def parse(value, path):
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise DeepSpeedConfigError(f"config key '{path}' must be an integer, got {_describe(value)}")
        if allowed is not None and value not in allowed:
            raise DeepSpeedConfigError(f"config key '{path}' must be one of {list(allowed)}, got {value!r}")
        _check_range(value, path, minimum, maximum)
        return value

    return parse


def size() -> Parser:
    """A non-negative element count. Any finite number is accepted and truncated to int: JSON writes
    ``5e8`` as a float, and frameworks compute sizes such as ``0.9 * hidden * hidden``."""

    def parse(value, path):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DeepSpeedConfigError(f"config key '{path}' must be a non-negative number (an element count), "
                                       f"got {_describe(value)}")
        _check_range(value, path, 0, None)
        return int(value)

    return parse


def number(minimum: Optional[float] = None,
           maximum: Optional[float] = None,
           exclusive_minimum: bool = False,
           allow_inf: bool = False) -> Parser:
    """An int or float, returned as float. NaN is rejected; infinity only with ``allow_inf``."""

    def parse(value, path):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DeepSpeedConfigError(f"config key '{path}' must be a number, got {_describe(value)}")
        value = float(value)
        if math.isnan(value) or (math.isinf(value) and not allow_inf):
            raise DeepSpeedConfigError(f"config key '{path}' must be a finite number, got {value!r}")
        if exclusive_minimum and minimum is not None and value <= minimum:
            raise DeepSpeedConfigError(f"config key '{path}' must be > {minimum}, got {value!r}")
        _check_range(value, path, minimum, maximum)
        return value

    return parse


def _check_range(value, path, minimum, maximum):
    if minimum is not None and value < minimum:
        raise DeepSpeedConfigError(f"config key '{path}' must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise DeepSpeedConfigError(f"config key '{path}' must be <= {maximum}, got {value!r}")


def string() -> Parser:

    def parse(value, path):
        if not isinstance(value, str):
            raise DeepSpeedConfigError(f"config key '{path}' must be a string, got {_describe(value)}")
        return value

    return parse


def filesystem_path() -> Parser:
    """A ``str`` or ``os.PathLike``, returned as ``str``."""

    def parse(value, path):
        if not isinstance(value, (str, os.PathLike)):
            raise DeepSpeedConfigError(f"config key '{path}' must be a filesystem path string, got {_describe(value)}")
        return os.fspath(value)

    return parse


def one_of(choices: Iterable[str], convert: Optional[Callable[[str], Any]] = None) -> Parser:
    """A string matching one of ``choices`` case-insensitively; returns the canonical spelling
    (passed through ``convert`` when given)."""
    allowed = tuple(choices)
    canonical = {choice.lower(): choice for choice in allowed}

    def parse(value, path):
        if isinstance(value, str) and value.lower() in canonical:
            choice = canonical[value.lower()]
            return convert(choice) if convert is not None else choice
        raise DeepSpeedConfigError(f"config key '{path}' must be one of {list(allowed)}, got {_describe(value)}")

    return parse


def mapping() -> Parser:
    """Any dict, deep-copied; its contents are left to the consumer."""

    def parse(value, path):
        if not isinstance(value, dict):
            raise DeepSpeedConfigError(f"config key '{path}' must be a dict, got {_describe(value)}")
        return copy.deepcopy(value)

    return parse


def string_list() -> Parser:
    """A list of strings, returned as a tuple; a single string is taken as a one-element list."""

    def parse(value, path):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
            raise DeepSpeedConfigError(f"config key '{path}' must be a list of strings, got {_describe(value)}")
        return tuple(value)

    return parse


def optional(parser: Parser) -> Parser:
    """``None`` passes through; anything else goes to ``parser``."""

    def parse(value, path):
        return None if value is None else parser(value, path)

    return parse


def section(cls) -> Parser:
    """A nested :class:`ConfigSection`."""

    def parse(value, path):
        if isinstance(value, cls):  # an already built section (keyword construction passes these)
            return value
        return cls.from_dict(value, path)

    return parse


# Spellings accepted for a dtype, mapped to the torch dtype.
DTYPE_SPELLINGS: Dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "torch.float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "torch.float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
}


def dtype() -> Parser:
    """A floating dtype given as a string (``"fp32"``, ``"bf16"``, ``"float16"``, ...) or a torch.dtype."""

    def parse(value, path):
        if isinstance(value, torch.dtype) and value in DTYPE_SPELLINGS.values():
            return value
        if isinstance(value, str) and value.lower() in DTYPE_SPELLINGS:
            return DTYPE_SPELLINGS[value.lower()]
        raise DeepSpeedConfigError(f"config key '{path}' must be one of "
                                   "['fp32', 'fp16', 'bf16', 'float32', 'float16', 'bfloat16'], "
                                   f"got {_describe(value)}")

    return parse


#########################################
# Typed sections
#########################################


def join_path(path: str, key) -> str:
    """``"a.b"`` + ``"c"`` -> ``"a.b.c"``; an empty ``path`` is the top level."""
    return f"{path}.{key}" if path else str(key)


def config_field(default=dataclasses.MISSING,
                 *,
                 parse: Parser,
                 aliases: Tuple[str, ...] = (),
                 default_factory=dataclasses.MISSING):
    """Declare a section field: its default, its parser and any other key spellings that set it."""
    return dataclasses.field(default=default,
                             default_factory=default_factory,
                             metadata={
                                 "parse": parse,
                                 "aliases": tuple(aliases)
                             })


class ConfigSection:
    """Base of the frozen config-section dataclasses.

    Contract of :meth:`from_dict`: every key of the input is a field name or alias (else the error
    lists the valid keys), no field is given twice under two spellings, every value passes its
    parser, and ``_finalize`` has resolved cross-key rules. Unset fields keep their dataclass default.
    """

    @classmethod
    def from_dict(cls, raw, path: str):
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise DeepSpeedConfigError(f"config key '{path}' must be a dict, got {_describe(raw)}")
        by_key = {}
        for spec in dataclasses.fields(cls):
            if spec.init and "parse" in spec.metadata:
                by_key[spec.name] = spec
                for alias in spec.metadata["aliases"]:
                    by_key[alias] = spec
        values, spelled = {}, {}
        for key, value in raw.items():
            spec = by_key.get(key)
            if spec is None:
                raise DeepSpeedConfigError(f"unknown config key '{join_path(path, key)}'; valid keys of '{path}' "
                                           f"are: {', '.join(sorted(by_key))}")
            if spec.name in values:
                raise DeepSpeedConfigError(f"config keys '{join_path(path, spelled[spec.name])}' and "
                                           f"'{join_path(path, key)}' set the same option; give only one")
            spelled[spec.name] = key
            values[spec.name] = spec.metadata["parse"](value, join_path(path, key))
        values = cls._finalize(values, spelled, path)
        return cls._from_values(values)

    @classmethod
    def _from_values(cls, values: dict):
        """Build the section from parsed field values (a section with its own ``__init__`` overrides this)."""
        return cls(**values)

    @classmethod
    def _finalize(cls, values: dict, spelled: dict, path: str) -> dict:
        """Hook for rules spanning several keys. ``values`` holds only the keys the user gave (by field
        name), ``spelled`` maps each to the key as written. Returns the field values to construct with."""
        return values

    def to_dict(self) -> dict:
        """Field values as a plain dict (nested sections included), for printing and checkpoints."""
        result = {}
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            result[spec.name] = value.to_dict() if isinstance(value, ConfigSection) else value
        return result


class ConfigDict(dict):
    """A dict whose keys can also be read as attributes (``cfg.partition_activations``)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def get_scalar_param(param_dict: dict, param_name: str, param_default_value):
    """``param_dict.get(param_name, default)``, kept under its upstream name."""
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: dict, param_name: str, param_default_value):
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: dict, param_name: str, param_default_value):
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs):
    """``json`` object-pairs hook: a dict of the pairs; ``ValueError`` listing the keys given more than once."""
    seen, repeated = {}, []
    for key, value in ordered_pairs:
        if key in seen and key not in repeated:
            repeated.append(key)
        seen[key] = value
    if repeated:
        raise ValueError(f"Duplicate keys in DeepSpeed config: {repeated}")
    return seen


def get_config_default(config, field_name):
    """The default of ``field_name`` in a config class or instance (a pydantic model or a section here)."""
    fields = getattr(config, "model_fields", None)
    if fields is not None:
        if field_name not in fields:
            raise AssertionError(f"'{field_name}' is not a field in {config}")
        if fields[field_name].is_required():
            raise AssertionError(f"'{field_name}' is a required field and does not have a default value")
        return fields[field_name].get_default()
    for spec in dataclasses.fields(config):
        if spec.name == field_name:
            if spec.default is not dataclasses.MISSING:
                return spec.default
            if spec.default_factory is not dataclasses.MISSING:
                return spec.default_factory()
            raise AssertionError(f"'{field_name}' is a required field and does not have a default value")
    raise AssertionError(f"'{field_name}' is not a field in {config}")


class pp_int(int):
    """An int that prints with thousands separators (``10,000``), or as ``custom_print_str`` when given."""

    def __new__(cls, val, custom_print_str=None):
        obj = super().__new__(cls, val)
        obj.custom_print_str = custom_print_str
        return obj

    def __repr__(self):
        return self.custom_print_str if self.custom_print_str else f"{int(self):,}"


class ScientificNotationEncoder(json.JSONEncoder):
    """``json.dumps(..., cls=ScientificNotationEncoder)``: numbers above 1e3 in scientific notation
    (``5.000000e+08``), the rest as usual, mappings one key per line."""

    def iterencode(self, o, _one_shot=False, level=0):
        indent = " " * (self.indent if self.indent is not None else 4)
        if isinstance(o, bool):
            return "true" if o else "false"
        if isinstance(o, (int, float)):
            return f"{o:e}" if o > 1e3 else f"{o}"
        if isinstance(o, dict):
            inner = indent * (level + 1)
            items = [f'\n{inner}"{k}": {self.iterencode(v, level=level + 1)}' for k, v in o.items()]
            return "{" + ", ".join(items) + f"\n{indent * level}" + "}"
        if isinstance(o, (list, tuple)):
            return "[" + ", ".join(self.iterencode(v, level=level) for v in o) + "]"
        return "".join(super().iterencode(o, _one_shot))


class DeepSpeedConfigObject:
    """An object whose ``repr`` is its attributes as indented JSON (large numbers in scientific notation)."""

    def repr(self):
        return self.__dict__

    def __repr__(self):
        return json.dumps(self.__dict__, sort_keys=True, indent=4, cls=ScientificNotationEncoder, default=str)


def __getattr__(name):
    # DeepSpeedConfigModel needs pydantic, which only code written against upstream's sections uses: it is
    # imported on first use of the name (see configuration/model.py).
    if name == "DeepSpeedConfigModel":
        from .configuration.model import DeepSpeedConfigModel
        return DeepSpeedConfigModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
