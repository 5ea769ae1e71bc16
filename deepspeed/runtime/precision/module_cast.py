# SPDX-License-Identifier: Apache-2.0
"""Casting a model to the training precision: parameters follow fp16/bf16, buffers keep their dtype.

With ``fp16`` or ``bf16`` enabled the model's floating-point parameters are cast to that dtype. Floating-point
buffers are left as they were loaded (an fp32 rotary ``inv_freq`` or BatchNorm statistic stays fp32) unless
``data_types.buffer_dtype`` names a dtype, which every floating-point buffer is then cast to. This is upstream's
rule (FSDP's ``MixedPrecisionPolicy`` has the same split). Integer and boolean tensors are never cast.

``data_types.param_dtype`` may repeat the dtype that ``fp16``/``bf16`` choose, never contradict it: the masters,
the loss scaling and the reduction all follow those sections, so a different parameter dtype would train in a
precision nothing else expects. ``DeepSpeedEngine._mixed_precision_dtypes``, ``_assert_valid_mixed_precision_config``
and ``_cast_module_mixed_precision`` (upstream's names) are these functions.
"""

import torch

from deepspeed.runtime.config_utils import DeepSpeedConfigError, dtype

_parse_dtype = dtype()


def _as_dtype(value, key):
    return None if value is None else _parse_dtype(value, f"data_types.{key}")


def mixed_precision_dtypes(fp16_enabled, bf16_enabled, buffer_dtype=None):
    """``(param_dtype, buffer_dtype)`` for the module cast: the fp16/bf16 dtype (None when neither is enabled) and
    ``data_types.buffer_dtype`` (None: buffers keep their dtype). ``buffer_dtype`` may be a string or a dtype."""
    param_dtype = torch.float16 if fp16_enabled else torch.bfloat16 if bf16_enabled else None
    return param_dtype, _as_dtype(buffer_dtype, "buffer_dtype")


class MixedPrecisionConfigError(DeepSpeedConfigError, AssertionError):
    """``data_types.param_dtype`` contradicts the fp16/bf16 sections (an ``AssertionError`` too, as upstream's)."""


def check_param_dtype(param_dtype, fp16_enabled, bf16_enabled):
    """Raise :class:`MixedPrecisionConfigError` unless ``data_types.param_dtype`` is unset or is the dtype the
    fp16/bf16 sections train in (fp32 when neither is enabled)."""
    requested = _as_dtype(param_dtype, "param_dtype")
    if requested is None:
        return
    model_dtype = mixed_precision_dtypes(fp16_enabled, bf16_enabled)[0] or torch.float32
    if requested != model_dtype:
        enabled = "fp16" if fp16_enabled else "bf16" if bf16_enabled else "neither fp16 nor bf16"
        raise MixedPrecisionConfigError(
            f"data_types.param_dtype={param_dtype!r} conflicts with the precision sections ({enabled} enabled: "
            f"parameters train in {model_dtype}); set the fp16/bf16 'enabled' flag or leave data_types.param_dtype "
            "out")


@torch.no_grad()
def cast_for_precision(module, param_dtype, buffer_dtype=None, keep_fp32_buffers=None):
    """Cast ``module``'s floating parameters to ``param_dtype`` (when it is not fp32) and its floating buffers to
    ``buffer_dtype`` (when given), in place (parameters stay the same objects). Buffers whose full names match
    ``keep_fp32_buffers`` (a compiled pattern, searched) are kept in, or brought back to, fp32."""
    param_dtype, buffer_dtype = _as_dtype(param_dtype, "param_dtype"), _as_dtype(buffer_dtype, "buffer_dtype")
    if param_dtype is not None and param_dtype != torch.float32:
        for param in module.parameters():
            if param.is_floating_point() and param.dtype != param_dtype:
                param.data = param.data.to(param_dtype)
    for name, buffer in list(module.named_buffers()):
        target = buffer_dtype
        if keep_fp32_buffers is not None and keep_fp32_buffers.search(name):
            target = torch.float32
        if target is not None and buffer.is_floating_point() and buffer.dtype != target:
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            owner._buffers[leaf] = buffer.to(target)
