# SPDX-License-Identifier: Apache-2.0
"""Write ``deepspeed/runtime/engine_parts/names.py``: the public names of upstream's engine classes and package.

Run it with upstream installed (not this package), from any directory but the repository root:

    /work/upvenv/bin/python tests/upstream/record_engine_surface.py deepspeed/runtime/engine_parts/names.py

The list is data: what ``tests/unit/runtime/test_engine_surface.py`` checks every name against.
"""

import inspect
import sys

HEADER = '''# SPDX-License-Identifier: Apache-2.0
"""The public names of upstream DeepSpeed {version}'s engines and top-level package (generated data).

Written by ``tests/upstream/record_engine_surface.py`` from upstream's classes: ``DEEPSPEED_ENGINE`` and
``PIPELINE_ENGINE`` map each public method or property name (``torch.nn.Module``'s included; the pipeline
engine's: those the base engine lacks) to its kind; ``TOP_LEVEL`` lists ``dir(deepspeed)``.
:func:`refuse_unresolved` keeps these names from falling through to the wrapped module.
"""

'''

FOOTER = '''

def refuse_unresolved(engine, name):
    """Raise an AttributeError naming the engine method when ``name`` is an upstream engine name ``engine``
    does not have (instead of the wrapped module's AttributeError, which names the user's model class)."""
    if name in DEEPSPEED_ENGINE or name in PIPELINE_ENGINE:
        where = "PipelineEngine" if name in PIPELINE_ENGINE else "DeepSpeedEngine"
        raise AttributeError(f"'{type(engine).__name__}' object has no attribute '{name}': upstream's "
                             f"{where}.{name} is not available on this engine (see docs/compatibility.md)")
'''


def _kinds(cls, skip=()):
    out = {}
    for name in sorted(dir(cls)):
        if name.startswith("_") or name in skip:
            continue
        value = inspect.getattr_static(cls, name)
        if isinstance(value, property):
            out[name] = "property"
        elif isinstance(value, (staticmethod, classmethod)) or callable(value):
            out[name] = "method"
        else:
            out[name] = "attribute"
    return out


def _mapping(name, kinds):
    return f"{name} = {{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in kinds.items()) + "}\n\n"


def main(path):
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine
    base = _kinds(DeepSpeedEngine)
    with open(path, "w") as handle:
        handle.write(HEADER.format(version=deepspeed.__version__))
        handle.write(f"UPSTREAM_VERSION = {deepspeed.__version__!r}\n\n")
        handle.write(_mapping("DEEPSPEED_ENGINE", base))
        handle.write(_mapping("PIPELINE_ENGINE", _kinds(PipelineEngine, skip=base)))
        top = sorted(n for n in dir(deepspeed) if not n.startswith("_"))
        handle.write("TOP_LEVEL = (\n" + "".join(f"    {n!r},\n" for n in top) + ")\n")
        handle.write(FOOTER)


if __name__ == "__main__":
    main(sys.argv[1])
