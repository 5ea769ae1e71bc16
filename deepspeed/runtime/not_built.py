# SPDX-License-Identifier: Apache-2.0
"""Stand-ins for upstream classes and functions of features this runtime does not build.

Each keeps upstream's name (so code importing it loads) and raises ``NotImplementedError`` naming the feature
as soon as it is used: constructing a class, calling a function. docs/compatibility.md lists the features.
"""


def _message(name, feature):
    return f"{name} ({feature}) is not built in this runtime; see docs/compatibility.md"


def not_built_class(name, feature, bases=(object, ), module=None):
    """A class called ``name`` whose construction raises ``NotImplementedError`` naming ``feature``."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(_message(name, feature))

    namespace = {"__init__": __init__, "__doc__": f"Upstream's ``{name}``: {feature}, not built here."}
    if module is not None:
        namespace["__module__"] = module
    return type(name, bases, namespace)


def not_built_function(name, feature, module=None):
    """A function called ``name`` that raises ``NotImplementedError`` naming ``feature``."""

    def function(*args, **kwargs):
        raise NotImplementedError(_message(name, feature))

    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"Upstream's ``{name}``: {feature}, not built here."
    if module is not None:
        function.__module__ = module
    return function
