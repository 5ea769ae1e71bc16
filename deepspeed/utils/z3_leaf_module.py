# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3 leaf modules: submodules gathered and released as one whole, with no hooks inside them.

A module flagged as a *leaf* (its ``_z3_leaf`` attribute, as upstream) becomes, when a
ZeRO-3 engine is built, the root of one parameter unit holding every parameter of its
subtree: the unit is gathered once at the leaf's own forward and on its backward visit,
and released after its backward; no module inside the subtree gets a hook. That is what
a mixture-of-experts layer needs: its router sends each batch to a data-dependent subset
of experts, so with one unit per expert the ranks would gather different experts, and
their collectives would not match. Each parameter of a leaf's subtree gets
``ds_z3_leaf_module`` (the leaf), which :func:`z3_leaf_parameter` reads.

Flags are read when the engine is built (``deepspeed.initialize``): set them before.
The ``zero_optimization.leaf_module`` config section (``classes``, ``names``,
``name_suffixes``) flags modules the same way (:func:`apply_zero_leaf_module_config`).
"""

from typing import List, Tuple

import torch

from deepspeed.utils.logging import logger

LEAF_FLAG = "_z3_leaf"
LEAF_PARAM_ATTR = "ds_z3_leaf_module"


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether ``model`` is flagged as a ZeRO-3 leaf module."""
    return bool(getattr(model, LEAF_FLAG, False))


def z3_leaf_parameter(model: torch.nn.Parameter) -> bool:
    """Whether the parameter ``model`` belongs to a leaf module's subtree (in a ZeRO-3 engine)."""
    return hasattr(model, LEAF_PARAM_ATTR)


def get_z3_leaf_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules of ``model`` (itself included) flagged as leaves, in ``modules()`` order."""
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool):
    """Flag (or unflag) the one module ``model``."""
    setattr(model, LEAF_FLAG, bool(flag))


def _qualified_name(module):
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(module, wanted):
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    return type(module).__name__ == wanted or _qualified_name(module) == wanted


def _flag_by_class(model, leaf_module_classes, flag, raise_if_not_found):
    classes = list(leaf_module_classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise ValueError(f"leaf_module_classes must be module classes or class names (str), got {bad}")
    matched = []
    for module in model.modules():
        if any(_matches(module, wanted) for wanted in classes):
            set_z3_leaf_module(module, flag)
            matched.append(module)
    if not matched and raise_if_not_found:
        raise ValueError(f"no module of the classes {classes} in the model ({type(model).__name__})")
    return matched


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True):
    """Flag every module of ``model`` that is an instance of one of ``leaf_module_classes`` as a ZeRO-3 leaf.

    ``leaf_module_classes``: classes (subclasses match too) or class names (the bare
    ``__name__`` or ``module.QualName``). Returns the modules flagged; ValueError when none
    matches and ``raise_if_not_found``.
    """
    return _flag_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True):
    """Clear the leaf flag of the modules :func:`set_z3_leaf_modules` would flag; returns them."""
    return _flag_by_class(model, leaf_module_classes, False, raise_if_not_found)


def _flag_by_name(model, names, match, flag, raise_if_not_found, what):
    named = list(model.named_modules())
    matched, missing, seen = [], [], set()
    for wanted in names:
        found = False
        for name, module in named:
            if match(name, wanted):
                found = True
                set_z3_leaf_module(module, flag)
                if id(module) not in seen:
                    seen.add(id(module))
                    matched.append(module)
        if not found:
            missing.append(wanted)
    if missing and raise_if_not_found:
        raise ValueError(f"no module {what} {missing} in the model ({type(model).__name__})")
    return matched, missing


def set_z3_leaf_modules_by_name(model: torch.nn.Module,
                                module_names,
                                flag: bool = True,
                                raise_if_not_found: bool = True) -> Tuple[List[torch.nn.Module], List[str]]:
    """Flag the modules named ``module_names`` (names of ``named_modules()``); ``(modules, missing names)``."""
    return _flag_by_name(model, module_names, lambda name, wanted: name == wanted, flag, raise_if_not_found, "named")


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module,
                                  module_name_suffixes,
                                  flag: bool = True,
                                  raise_if_not_found: bool = True) -> Tuple[List[torch.nn.Module], List[str]]:
    """Flag the modules whose ``named_modules()`` name ends with one of the suffixes; ``(modules, missing)``."""
    return _flag_by_name(model, module_name_suffixes, lambda name, wanted: name.endswith(wanted), flag,
                         raise_if_not_found, "whose name ends with")


def apply_zero_leaf_module_config(model: torch.nn.Module, leaf_cfg) -> List[torch.nn.Module]:
    """Flag the modules the ``zero_optimization.leaf_module`` section names; returns them (each once).

    Unknown names and suffixes, and a section that matches nothing, are logged when they
    differ from the defaults (the default classes are the Transformers MoE blocks, absent
    from most models).
    """
    if leaf_cfg is None:
        return []
    from deepspeed.runtime.zero.config import DeepSpeedZeroLeafModuleConfig
    defaults = DeepSpeedZeroLeafModuleConfig()
    matched, seen = [], set()

    def add(modules):
        for module in modules:
            if id(module) not in seen:
                seen.add(id(module))
                matched.append(module)

    if leaf_cfg.classes:
        add(set_z3_leaf_modules(model, leaf_cfg.classes, raise_if_not_found=False))
    if leaf_cfg.names:
        modules, missing = set_z3_leaf_modules_by_name(model, leaf_cfg.names, raise_if_not_found=False)
        add(modules)
        if missing:
            raise ValueError(f"zero_optimization.leaf_module.names: the model has no module named {missing} (names "
                             f"are paths from named_modules(); use name_suffixes for a pattern)")
    if leaf_cfg.name_suffixes:
        modules, missing = set_z3_leaf_modules_by_suffix(model, leaf_cfg.name_suffixes, raise_if_not_found=False)
        add(modules)
        if missing:
            logger.warning(f"zero_optimization.leaf_module.name_suffixes: no module name ends with {missing}")
    customized = (tuple(leaf_cfg.classes) != tuple(defaults.classes) or bool(leaf_cfg.names)
                  or bool(leaf_cfg.name_suffixes))
    if customized and not matched:
        logger.warning("zero_optimization.leaf_module matches no module of the model; no module is a leaf")
    return matched
