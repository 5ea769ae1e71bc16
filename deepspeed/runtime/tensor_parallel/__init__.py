# SPDX-License-Identifier: Apache-2.0
"""Automatic tensor parallelism for training (AutoTP), under upstream's module paths (docs/tensor_parallel.md).

``config``: the ``tensor_parallel`` section; ``init_utils``: ``tp_model_init`` and its merge rules;
``plan``: the sharding plan from partition_config / presets, HF ``tp_plan`` or the heuristic;
``sharding``: the one function that applies a plan; ``mappings``: the four collectives;
``replicated``: which replicated parameters act on sharded activations; ``data_check``: the
first forward's checks; ``training``: the engine's part; ``checkpoint``: whole tensors and
other tensor-parallel sizes.
"""

from .config import AUTOTP_MODE, TPConfig, TPTrainingConfig, get_tensor_parallel_config  # noqa: F401


def __getattr__(name):
    # ``TpTrainingManager`` is upstream's name here, but its module reaches ``module_inject.layers``, which reads
    # ``mappings`` of this package: importing it on first use keeps that from closing an import circle.
    if name == "TpTrainingManager":
        from .tp_manager import TpTrainingManager
        return TpTrainingManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AUTOTP_MODE", "TPConfig", "TPTrainingConfig", "get_tensor_parallel_config", "TpTrainingManager"]


def __dir__():
    return sorted(set(globals()) | set(__all__))
