# SPDX-License-Identifier: Apache-2.0
"""``ALL_OPS``: every op builder by op name, the ones built here first."""

from .async_io import AsyncIOBuilder
from .block_quant import BlockQuantBuilder
from .builder import UnsupportedOpBuilder
from .cpu_adam import CPUAdamBuilder
from .grad_ops import GradOpsBuilder
from .torch_ops import TORCH_BUILDERS
from .unsupported import UNSUPPORTED_BUILDERS

BUILT_BUILDERS = [CPUAdamBuilder, GradOpsBuilder, AsyncIOBuilder, BlockQuantBuilder]
TORCH_OP_NAMES = {builder.NAME for builder in TORCH_BUILDERS}
"""The ops this package builds (prebuilt by ``DS_BUILD_OPS=1``, JIT otherwise)."""

ALL_OPS = {builder.NAME: builder() for builder in BUILT_BUILDERS + TORCH_BUILDERS + UNSUPPORTED_BUILDERS}


def prebuild_selection(environ):
    """Which ops ``setup.py`` prebuilds, from ``DS_BUILD_OPS`` and the ops' ``DS_BUILD_<NAME>`` variables.

    ``DS_BUILD_OPS=1`` selects every op this package builds that is compatible here (an incompatible one is
    skipped with its reason); ``DS_BUILD_<NAME>=0`` leaves one out, ``DS_BUILD_<NAME>=1`` selects one on its own.
    Returns ``(builders, notes)``: the builder instances to build and one line per op left out. Raises
    RuntimeError when an op asked for by name cannot be built here.
    """
    build_all = environ.get("DS_BUILD_OPS", "0") == "1"
    builders, notes = [], []
    for builder in (cls() for cls in BUILT_BUILDERS):
        flag = environ.get(builder.BUILD_VAR)
        wanted = flag == "1" or (build_all and flag != "0")
        if not wanted:
            continue
        reason = builder.incompatible_reason()
        if reason is None:
            builders.append(builder)
        elif flag == "1":
            raise RuntimeError(f"{builder.BUILD_VAR}=1 but the {builder.NAME} op cannot be built here: {reason}")
        else:
            notes.append(f"not prebuilding {builder.NAME}: {reason}")
    for name, builder in ALL_OPS.items():
        if builder.BUILD_VAR and environ.get(builder.BUILD_VAR) == "1" and isinstance(builder, UnsupportedOpBuilder):
            notes.append(f"{builder.BUILD_VAR}=1 ignored: {name} is not built by this package ({builder.REASON})")
        elif builder.BUILD_VAR and environ.get(builder.BUILD_VAR) == "1" and name in TORCH_OP_NAMES:
            notes.append(f"{builder.BUILD_VAR}=1 ignored: {name} is implemented in torch ({builder.MODULE}), "
                         f"nothing to build")
    return builders, notes
