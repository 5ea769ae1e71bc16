# SPDX-License-Identifier: Apache-2.0
"""Casting a model to the training precision: parameters follow fp16/bf16, buffers keep their dtype.

With ``fp16`` or ``bf16`` enabled the model's floating-point parameters are cast to that dtype. Floating-point
buffers are left as they were loaded (an fp32 rotary ``inv_freq`` or BatchNorm statistic stays fp32) unless
``data_types.buffer_dtype`` names a dtype, which every floating-point buffer is then cast to. This is upstream's
rule (FSDP's ``MixedPrecisionPolicy`` has the same split). Integer and boolean tensors are never cast.
"""

import torch


@torch.no_grad()
def cast_for_precision(module, param_dtype, buffer_dtype=None):
    """Cast ``module``'s floating parameters to ``param_dtype`` (when it is not fp32) and its floating buffers to
    ``buffer_dtype`` (when given), in place (parameters stay the same objects)."""
    if param_dtype is not None and param_dtype != torch.float32:
        for param in module.parameters():
            if param.is_floating_point() and param.dtype != param_dtype:
                param.data = param.data.to(param_dtype)
    if buffer_dtype is not None:
        for name, buffer in list(module.named_buffers()):
            if buffer.is_floating_point() and buffer.dtype != buffer_dtype:
                owner_name, _, leaf = name.rpartition(".")
                owner = module.get_submodule(owner_name) if owner_name else module
                owner._buffers[leaf] = buffer.to(buffer_dtype)
