# SPDX-License-Identifier: Apache-2.0
"""Get and set a submodule (or any attribute) by its dotted path, ``"encoder.layer.0.attn"``."""


def recursive_getattr(model, module_name):
    """``model.<a>.<b>...`` for ``module_name = "a.b..."``."""
    target = model
    for name in module_name.split("."):
        target = getattr(target, name)
    return target


def recursive_setattr(model, module_name, module):
    """Set ``model.<a>.<b>... = module`` for ``module_name = "a.b..."`` (the parents must exist)."""
    *parents, leaf = module_name.split(".")
    target = model
    for name in parents:
        target = getattr(target, name)
    setattr(target, leaf, module)
