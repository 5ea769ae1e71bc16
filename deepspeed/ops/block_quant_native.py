# SPDX-License-Identifier: Apache-2.0
"""The host op of ``csrc/quantization/block_quant.cpp``, registered as the implementation of
``deepspeed.runtime.zero.gradients.block_quant`` for host tensors.

The wrappers keep the contract of the torch reference bit for bit (tests compare them): host tensors of float32
or bfloat16 with contiguous rows go to the op, anything else (device tensors, float16) to the torch reference.

:func:`register` decides, for an engine on ``device``:

* ``DS_NATIVE_BLOCK_QUANT=1``: installed; ``DS_NATIVE_BLOCK_QUANT=0``: not;
* unset: installed for an engine on the CPU, where it made the ZeRO-3 step with qwZ / qgZ faster end to end
  (``benchmarks/zeropp_bytes.py --cpu --world 4 --native``: 1.5-2x shorter steps on 4 CPU processes; the op
  alone is 6-8x faster than the torch chain); not for a GPU engine, whose quantized rows are device tensors
  the host op never sees (no build is attempted then).

``DS_BLOCK_QUANT=torch`` (read by ``block_quant.use_native``) keeps the torch reference whatever is set. Where the
op cannot be built (no C++ compiler) nothing is registered and one line in the log says so.
"""

import os

import torch

from deepspeed.ops.native import load_op
from deepspeed.ops.op_builder import BlockQuantBuilder
from deepspeed.runtime.zero.gradients import block_quant

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


def register(device="cpu", environ=None):
    """Install the host op as the module docstring says; returns whether it is in use."""
    environ = os.environ if environ is None else environ
    flag = environ.get("DS_NATIVE_BLOCK_QUANT")
    wanted = flag == "1" or (flag is None and torch.device(device).type == "cpu")
    if not wanted or environ.get("DS_BLOCK_QUANT", "").lower() == "torch" or load() is None:
        return False
    return (block_quant.use_native("quantize_rows", quantize_rows)
            and block_quant.use_native("dequantize_rows", dequantize_rows))
