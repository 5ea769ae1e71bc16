# SPDX-License-Identifier: Apache-2.0
"""Block quantization of rows for ZeRO++'s quantized transports (qwZ, qgZ), with the torch reference.

A row of ``C`` values is cut into blocks of ``block`` values (the last one padded with zeros) and each block
is quantized *symmetrically* to ``bits`` (8 or 4) bits, as upstream's ZeRO++ quantizer does::

    scale = max |x| over the block / qmax          (qmax = 2**(bits - 1) - 1: 127 or 7; fp32)
    q     = clamp(round_half_even(x / scale), -qmax, qmax)    (0 where the block is all zeros)
    x'    = q * scale

so every element's error is at most ``scale / 2`` (half a step of its own block), before the final cast to
the destination dtype. A packed row is ``bytes`` of one ``uint8`` tensor: the codes (one byte each for 8
bits; two per byte for 4 bits, the even element in the low nibble), then the block scales as float32
bytes: :func:`row_bytes` of them. Rows are packed independently, so the rows of a rank-major unit buffer
(one per destination rank) can be sent to different ranks.

The torch functions below are the reference and always present (and what runs on the GPU).
``csrc/quantization/block_quant.cpp`` (``deepspeed.ops.op_builder.BlockQuantBuilder``) computes the same bits on
the host in one threaded pass; ``deepspeed.ops.block_quant_native.register`` installs it through
:func:`use_native` for CPU engines, where it made the step faster.
"""

import os

import torch

WEIGHT_BITS = 8  # qwZ: int8 weights (upstream's all-gather quantizer is 8-bit symmetric)
WEIGHT_BLOCK = 4096  # upstream groups weights in blocks of at most 8000 elements, about 4k being its sweet spot
GRAD_BITS = 4  # qgZ: int4 gradients on both hops of the hierarchical all-to-all, as upstream
GRAD_BLOCK = 512  # gradient blocks are smaller: 4 bits leave 7 steps a side, so a block's range matters more


def qmax(bits):
    return (1 << (bits - 1)) - 1


def num_blocks(numel, block):
    return max(1, -(-int(numel) // int(block)))


def payload_bytes(numel, bits, block):
    """Bytes of the codes of a row of ``numel`` values (padded to whole blocks)."""
    return num_blocks(numel, block) * block * bits // 8


def row_bytes(numel, bits, block):
    """Bytes of one packed row of ``numel`` values: codes, then one float32 scale per block."""
    return payload_bytes(numel, bits, block) + 4 * num_blocks(numel, block)


def _check(bits, block):
    if bits not in (4, 8):
        raise ValueError(f"block quantization takes 4 or 8 bits, not {bits}")
    if block < 2 or block % 2:
        raise ValueError(f"block quantization needs an even block size, not {block}")


def torch_quantize_rows(x, bits, block, out=None):
    """Pack every row of the 2-D ``x`` (any float dtype) into ``(rows, row_bytes)`` uint8 (module docstring)."""
    _check(bits, block)
    rows, numel = x.shape
    blocks = num_blocks(numel, block)
    values = x.float()
    if blocks * block != numel:
        values = torch.nn.functional.pad(values, (0, blocks * block - numel))
    values = values.view(rows, blocks, block)
    top = qmax(bits)
    scales = values.abs().amax(dim=2) / top
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(values / safe.unsqueeze(2)).clamp_(-top, top).to(torch.int8).view(rows, blocks * block)
    if bits == 4:
        low = codes[:, 0::2].view(torch.uint8) & 0xF
        high = codes[:, 1::2].view(torch.uint8) << 4
        codes = (low | high).view(torch.int8)
    payload = payload_bytes(numel, bits, block)
    if out is None:
        out = torch.empty(rows, payload + 4 * blocks, dtype=torch.uint8, device=x.device)
    out[:, :payload].copy_(codes.view(torch.uint8))
    out[:, payload:].copy_(scales.contiguous().view(torch.uint8))
    return out


def torch_dequantize_rows(packed, numel, bits, block, out):
    """Unpack ``packed`` (``(rows, row_bytes)`` uint8) into the 2-D ``out`` (``(rows, numel)``, any float dtype)."""
    _check(bits, block)
    rows = packed.shape[0]
    blocks = num_blocks(numel, block)
    payload = payload_bytes(numel, bits, block)
    codes = packed[:, :payload]
    scales = packed[:, payload:].clone(memory_format=torch.contiguous_format).view(torch.float32).view(rows, blocks, 1)
    if bits == 4:
        low = (codes & 0xF).view(torch.int8)
        high = (codes >> 4).view(torch.int8)
        # sign-extend the nibbles: 8..15 stand for -8..-1
        low = torch.where(low >= 8, low - 16, low)
        high = torch.where(high >= 8, high - 16, high)
        values = torch.stack((low, high), dim=2).view(rows, blocks * block)
    else:
        values = codes.view(torch.int8)
    values = (values.float().view(rows, blocks, block) * scales).view(rows, blocks * block)
    out.copy_(values[:, :numel])
    return out


_impl = {"quantize_rows": torch_quantize_rows, "dequantize_rows": torch_dequantize_rows}


def quantize_rows(x, bits, block, out=None):
    """Pack the rows of ``x`` (see :func:`torch_quantize_rows`); the native op where it was selected."""
    return _impl["quantize_rows"](x, bits, block, out)


def dequantize_rows(packed, numel, bits, block, out):
    """Unpack rows into ``out`` (see :func:`torch_dequantize_rows`); the native op where it was selected."""
    return _impl["dequantize_rows"](packed, numel, bits, block, out)


def use_native(name, fn):
    """Replace the function ``name`` with ``fn`` (same contract, same bits); ignored with ``DS_BLOCK_QUANT=torch``.
    Returns whether ``fn`` is now in use."""
    if name not in _impl:
        raise KeyError(name)
    if os.environ.get("DS_BLOCK_QUANT", "").lower() == "torch":
        return False
    _impl[name] = fn
    return True


def reset():
    """Back to the torch reference."""
    _impl["quantize_rows"] = torch_quantize_rows
    _impl["dequantize_rows"] = torch_dequantize_rows


def implementation(name):
    return _impl[name]
