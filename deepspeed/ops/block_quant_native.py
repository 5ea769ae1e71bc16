# SPDX-License-Identifier: Apache-2.0
"""The host op of ``csrc/quantization/block_quant.cpp``, registered as the implementation of
``deepspeed.runtime.zero.block_quant`` for host tensors.

The wrappers keep the contract of the torch reference bit for bit (tests compare them): host tensors of float32
or bfloat16 with contiguous rows go to the op, anything else (device tensors, float16) to the torch reference.

:func:`register` installs them when ``DS_NATIVE_BLOCK_QUANT=1``. It is opt-in: the quantized transports run on
the device in GPU training, where this host op does not apply, and on the host the step time of the CPU test
models did not measurably change with it (the collectives dominate; ``benchmarks/zeropp_bytes.py --native``
measures both). Where the op cannot be built (no C++ compiler) nothing is registered and one line in the log
says so.
"""

import os

import torch

from deepspeed.ops.native import load_op
from deepspeed.ops.op_builder import BlockQuantBuilder
from deepspeed.runtime.zero import block_quant

_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_op = None


def load():
    """The loaded op module, or None where it cannot be built here (noted once in the log)."""
    global _op
    if _op is None:
        _op = load_op(BlockQuantBuilder(), "ZeRO++ block quantization")
    return _op


def _raise_if(error):
    if error:
        raise RuntimeError(error)


def _takes(tensor):
    return (tensor.device.type == "cpu" and tensor.dtype in _KINDS and tensor.dim() == 2 and tensor.stride(1) == 1)


def quantize_rows(x, bits, block, out=None):
    op = load()
    if op is None or not _takes(x):
        return block_quant.torch_quantize_rows(x, bits, block, out)
    rows, numel = x.shape
    if out is None:
        out = torch.empty(rows, block_quant.row_bytes(numel, bits, block), dtype=torch.uint8)
    if not out.is_contiguous():
        return block_quant.torch_quantize_rows(x, bits, block, out)
    _raise_if(op.quantize_rows(x.data_ptr(), _KINDS[x.dtype], x.stride(0), out.data_ptr(), rows, numel, bits, block))
    return out


def dequantize_rows(packed, numel, bits, block, out):
    op = load()
    if op is None or not _takes(out) or packed.device.type != "cpu" or not packed.is_contiguous():
        return block_quant.torch_dequantize_rows(packed, numel, bits, block, out)
    _raise_if(
        op.dequantize_rows(packed.data_ptr(), out.data_ptr(), _KINDS[out.dtype], out.stride(0), packed.shape[0], numel,
                           bits, block))
    return out


def register(environ=None):
    """Install the host op where ``DS_NATIVE_BLOCK_QUANT=1`` and it loads; returns whether it is in use."""
    environ = os.environ if environ is None else environ
    if environ.get("DS_NATIVE_BLOCK_QUANT", "0") != "1" or load() is None:
        return False
    return (block_quant.use_native("quantize_rows", quantize_rows)
            and block_quant.use_native("dequantize_rows", dequantize_rows))
