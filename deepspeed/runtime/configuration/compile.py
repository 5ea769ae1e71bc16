# SPDX-License-Identifier: Apache-2.0
"""The ``compile`` section (upstream's DeepCompile settings) and what each key means here.

``"compile": {"deepcompile": true}`` runs this runtime's compiled path: ``engine.compile()`` compiles the
module with ``torch.compile`` and the engine's hooks (ZeRO-3 gathers and releases, the backward session)
run eagerly between compiled regions, so gradients stay exact on every stage (docs/zero.md, "torch.compile").
As upstream, nothing is compiled until ``engine.compile()`` is called.

The other keys, at their defaults, ask for nothing. Set otherwise:

* ``passes``: ``"z1"`` / ``"z3"`` name the ZeRO pass of DeepCompile; here the ZeRO stage of the config does
  that work, so ``"z1"`` with stage 1 or 2 and ``"z3"`` with stage 3 are honoured as the stage itself; a pass
  that contradicts the stage, ``"autosp"`` and ``"autotp"`` are refused by name;
* ``free_activation_threshold`` and ``offload_activation_pin_memory`` only tune a switch that is off: accepted;
* every other key (``free_activation``, ``offload_activation``, ``offload_opt_states``, ``offload_parameters``,
  ``double_buffer: false``, ``symmetric_memory``, the ``sync_*`` keys, ``debug_log``, ``keep_*_input_tensors``,
  ``autoep_non_moe``) names a DeepCompile graph pass or option this runtime does not build: refused by name.
"""

from dataclasses import dataclass, field
from typing import Tuple

from deepspeed.runtime.config_utils import DeepSpeedConfigError

DEFAULTS = {
    "deepcompile": False,
    "autoep_non_moe": False,
    "free_activation": False,
    "free_activation_threshold": 10 * 1024 * 1024,
    "offload_activation": False,
    "offload_activation_pin_memory": True,
    "offload_opt_states": False,
    "double_buffer": True,
    "symmetric_memory": False,
    "debug_log": False,
    "offload_parameters": False,
    "sync_before_reduce": False,
    "sync_after_reduce": False,
    "sync_before_allgather": False,
    "sync_after_allgather": False,
    "keep_int_input_tensors": True,
    "keep_all_input_tensors": False,
    "passes": None,
}
INERT_WITHOUT_SWITCH = ("free_activation_threshold", "offload_activation_pin_memory")
PASSES = ("z1", "z3", "autosp", "autotp")


@dataclass(frozen=True)
class CompileSettings:
    """The parsed ``compile`` section (upstream's ``CompileConfig`` fields that mean something here)."""
    deepcompile: bool = False
    passes: Tuple[str, ...] = field(default_factory=tuple)


def _bool(key, value):
    if not isinstance(value, bool):
        raise DeepSpeedConfigError(f"config key 'compile.{key}' must be a boolean, got {value!r}")
    return value


def parse_compile_section(section, zero_stage):
    """The :class:`CompileSettings` of ``section`` (the config's ``compile`` dict or None); raises
    ``DeepSpeedConfigError`` for malformed values and ``NotImplementedError`` naming each key this runtime
    does not build (see the module docstring)."""
    if section is None:
        return CompileSettings()
    if not isinstance(section, dict):
        raise DeepSpeedConfigError(f"config key 'compile' must be a dict, got {type(section).__name__}")
    unknown = sorted(set(section) - set(DEFAULTS))
    if unknown:
        raise DeepSpeedConfigError(f"config key 'compile.{unknown[0]}' is not a compile setting; the settings are "
                                   f"{sorted(DEFAULTS)}")
    for key, value in section.items():
        if key in ("deepcompile", "passes"):
            continue
        if key in INERT_WITHOUT_SWITCH:  # validated, nothing to honour while their switch is off
            if isinstance(DEFAULTS[key], bool):
                _bool(key, value)
            elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise DeepSpeedConfigError(f"config key 'compile.{key}' must be a non-negative integer, got {value!r}")
            continue
        if isinstance(DEFAULTS[key], bool):
            _bool(key, value)
        if value != DEFAULTS[key]:
            raise NotImplementedError(f"config key 'compile.{key}' ({value!r}) is not supported: DeepCompile's "
                                      f"graph passes are not built; 'compile.deepcompile' runs engine.compile() "
                                      f"(torch.compile with the engine's hooks eager); see docs/compatibility.md")
    deepcompile = _bool("deepcompile", section.get("deepcompile", False))
    passes = section.get("passes")
    passes = tuple(passes) if passes is not None else ()
    for name in passes:
        if name not in PASSES:
            raise DeepSpeedConfigError(f"config key 'compile.passes' holds {name!r}; the passes are {list(PASSES)}")
        if name in ("autosp", "autotp"):
            raise NotImplementedError(f"config key 'compile.passes' {name!r} (DeepCompile's {name.upper()} pass) is "
                                      f"not supported; see docs/compatibility.md")
        wanted = (3, ) if name == "z3" else (1, 2)
        if zero_stage not in wanted:
            raise NotImplementedError(f"config key 'compile.passes' {name!r} asks for ZeRO stage "
                                      f"{' or '.join(map(str, wanted))} through the compiler, but "
                                      f"zero_optimization.stage is {zero_stage}; here the ZeRO stage of the config "
                                      f"does the pass's work (see docs/compatibility.md)")
    return CompileSettings(deepcompile=deepcompile, passes=passes)
