# SPDX-License-Identifier: Apache-2.0
"""Builders for upstream ops this package does not build.

Upstream's tests and some frameworks import these classes and read ``deepspeed.ops.__compatible_ops__[NAME]``
before using an op; here each one exists under upstream's class name and ``NAME``, reports itself not compatible
with the reason below, and raises NotImplementedError from ``load()``. docs/compatibility.md lists them.
"""

from .builder import UnsupportedOpBuilder


class GDSBuilder(UnsupportedOpBuilder):
    NAME = "gds"
    BUILD_VAR = "DS_BUILD_GDS"
    REASON = ("GPUDirect Storage is not supported; NVMe offload reads and writes through pinned host buffers "
              "(the async_io op)")


class FusedLambBuilder(UnsupportedOpBuilder):
    NAME = "fused_lamb"
    BUILD_VAR = "DS_BUILD_FUSED_LAMB"
    REASON = "deepspeed.ops.lamb.FusedLamb runs on torch tensor operations, which need no separate op"


class EvoformerAttnBuilder(UnsupportedOpBuilder):
    NAME = "evoformer_attn"
    BUILD_VAR = "DS_BUILD_EVOFORMER_ATTN"
    REASON = "the Evoformer attention kernels are not part of this training runtime"


class FPQuantizerBuilder(UnsupportedOpBuilder):
    NAME = "fp_quantizer"
    BUILD_VAR = "DS_BUILD_FP_QUANTIZER"
    REASON = "FP quantization kernels are not part of this training runtime"


class QuantizerBuilder(UnsupportedOpBuilder):
    NAME = "quantizer"
    BUILD_VAR = "DS_BUILD_QUANTIZER"
    REASON = "quantization kernels are not part of this training runtime"


class RandomLTDBuilder(UnsupportedOpBuilder):
    NAME = "random_ltd"
    BUILD_VAR = "DS_BUILD_RANDOM_LTD"
    REASON = "random layer-token drop is not part of this training runtime"


class SparseAttnBuilder(UnsupportedOpBuilder):
    NAME = "sparse_attn"
    BUILD_VAR = "DS_BUILD_SPARSE_ATTN"
    REASON = "sparse attention is not part of this training runtime"


class TransformerBuilder(UnsupportedOpBuilder):
    NAME = "transformer"
    BUILD_VAR = "DS_BUILD_TRANSFORMER"
    REASON = "the fused transformer layer kernels are not part of this training runtime"


class StochasticTransformerBuilder(UnsupportedOpBuilder):
    NAME = "stochastic_transformer"
    BUILD_VAR = "DS_BUILD_STOCHASTIC_TRANSFORMER"
    REASON = "the fused transformer layer kernels are not part of this training runtime"


class InferenceBuilder(UnsupportedOpBuilder):
    NAME = "transformer_inference"
    BUILD_VAR = "DS_BUILD_TRANSFORMER_INFERENCE"
    REASON = "DeepSpeed inference is not part of this training runtime"


class SpatialInferenceBuilder(UnsupportedOpBuilder):
    NAME = "spatial_inference"
    BUILD_VAR = "DS_BUILD_SPATIAL_INFERENCE"
    REASON = "DeepSpeed inference is not part of this training runtime"


class InferenceCoreBuilder(UnsupportedOpBuilder):
    NAME = "inference_core_ops"
    BUILD_VAR = "DS_BUILD_INFERENCE_CORE_OPS"
    REASON = "DeepSpeed inference is not part of this training runtime"


class InferenceCutlassBuilder(UnsupportedOpBuilder):
    NAME = "cutlass_ops"
    BUILD_VAR = "DS_BUILD_CUTLASS_OPS"
    REASON = "DeepSpeed inference is not part of this training runtime"


class RaggedOpsBuilder(UnsupportedOpBuilder):
    NAME = "ragged_device_ops"
    BUILD_VAR = "DS_BUILD_RAGGED_DEVICE_OPS"
    REASON = "DeepSpeed inference (ragged batching) is not part of this training runtime"


class RaggedUtilsBuilder(UnsupportedOpBuilder):
    NAME = "ragged_ops"
    BUILD_VAR = "DS_BUILD_RAGGED_OPS"
    REASON = "DeepSpeed inference (ragged batching) is not part of this training runtime"


class DeepCompileBuilder(UnsupportedOpBuilder):
    NAME = "dc"
    BUILD_VAR = "DS_BUILD_DEEP_COMPILE"
    REASON = "DeepCompile is not supported; use torch.compile on the model"


class PinMemoryBuilder(UnsupportedOpBuilder):
    NAME = "pin_memory"
    BUILD_VAR = "DS_BUILD_PIN_MEMORY"
    REASON = ("the native page-locked allocator (DS_PIN_MEMORY_BACKEND=native) is not built; memory is pinned "
              "through torch")


class NotImplementedBuilder(UnsupportedOpBuilder):
    NAME = "deepspeed_not_implemented"
    BUILD_VAR = "DS_BUILD_NOT_IMPLEMENTED"
    REASON = "this op is not implemented for this accelerator"


UNSUPPORTED_BUILDERS = [
    GDSBuilder, FusedLambBuilder, EvoformerAttnBuilder, FPQuantizerBuilder, QuantizerBuilder, RandomLTDBuilder,
    SparseAttnBuilder, TransformerBuilder, StochasticTransformerBuilder, InferenceBuilder, SpatialInferenceBuilder,
    InferenceCoreBuilder, InferenceCutlassBuilder, RaggedOpsBuilder, RaggedUtilsBuilder, DeepCompileBuilder,
    PinMemoryBuilder, NotImplementedBuilder
]
