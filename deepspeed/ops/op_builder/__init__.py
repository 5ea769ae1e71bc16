# SPDX-License-Identifier: Apache-2.0
"""Op builders, by upstream's class names: ``from deepspeed.ops.op_builder import CPUAdamBuilder``.

``CPUAdamBuilder`` (the host Adam op), ``GradOpsBuilder`` (the gradient pipeline's CUDA kernels) and
``AsyncIOBuilder`` (asynchronous file I/O, the disk tier of offload) build real ops; ``fused_adam``, ``fused_lion``,
``cpu_lion`` and ``cpu_adagrad`` are implemented in torch (``torch_ops``); every other upstream builder is here so
that code probing for it works, and reports itself not compatible (``deepspeed.ops.op_builder.unsupported``).
``ALL_OPS`` maps op names to builder instances. The package imports nothing but the standard library at import time,
so ``setup.py`` loads it without importing ``deepspeed``.
"""

from .all_ops import ALL_OPS, BUILT_BUILDERS, prebuild_selection  # noqa: F401
from .async_io import AsyncIOBuilder  # noqa: F401
from .block_quant import BlockQuantBuilder  # noqa: F401
from .builder import (  # noqa: F401
    CUDAOpBuilder, OpBuilder, TorchCPUOpBuilder, UnsupportedOpBuilder, get_default_compute_capabilities)
from .cpu_adam import CPUAdamBuilder  # noqa: F401
from .grad_ops import GradOpsBuilder  # noqa: F401
from .torch_ops import (  # noqa: F401
    CPUAdagradBuilder, CPULionBuilder, FusedAdamBuilder, FusedLionBuilder, TorchImplementedOpBuilder)
from .unsupported import (  # noqa: F401
    DeepCompileBuilder, EvoformerAttnBuilder, FPQuantizerBuilder, FusedLambBuilder, GDSBuilder, InferenceBuilder,
    InferenceCoreBuilder, InferenceCutlassBuilder, NotImplementedBuilder, PinMemoryBuilder, QuantizerBuilder,
    RaggedOpsBuilder, RaggedUtilsBuilder, RandomLTDBuilder, SparseAttnBuilder, SpatialInferenceBuilder,
    StochasticTransformerBuilder, TransformerBuilder)

# Upstream's accelerators look for this marker to tell its op builders from a third party's.
__deepspeed__ = True


def builder_class(class_name):
    """The builder class called ``class_name`` (e.g. ``"CPUAdamBuilder"``), or None."""
    candidate = globals().get(class_name)
    return candidate if isinstance(candidate, type) and issubclass(candidate, OpBuilder) else None
