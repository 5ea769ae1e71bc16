# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels of ``csrc/grad_ops`` against float64 references and the torch functions they replace.

Every ``deepspeed.ops.grad_ops_native`` wrapper is called on fresh random data: float32/bfloat16/float16 (every
pair where source and destination types differ), odd sizes, zero-sized tensors, more tensors than one launch
takes, views at offsets that are not 16-byte aligned (the kernels' element-by-element path) with sentinels
between them (nothing outside a view may be written), poisoned outputs (every element must be written), factors
as floats and as device tensors. Non-contiguous, CPU and float64 inputs must be rejected with a clear error.

* ``python -m pytest tests/gpu/test_native_ops.py -q``: builds the op (JIT) on first use; skipped without CUDA.
* ``DS_GPU_TESTS_ON_CPU=1`` runs the same checks on CPU tensors, where the wrappers fall back to the torch
  implementations: this checks the references and the test itself, not the kernels.
"""

import os
import zlib

import pytest
import torch

from deepspeed.ops import grad_ops_native as native
from deepspeed.ops.native import load_error
from deepspeed.runtime.zero.gradients import grad_ops

pytestmark = pytest.mark.gpu

ON_CPU = os.environ.get("DS_GPU_TESTS_ON_CPU") == "1"
DEVICE = "cpu" if ON_CPU else "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
SIZE_SETS = {
    "one": [1],
    "odd": [7, 4095, 4096, 4097, 3],
    "zeros": [0, 5, 0, 33, 0],
    "large": [(1 << 20) + 3, 100003],
    "many": [(i * 37) % 1500 for i in range(230)],  # more segments than one launch takes
}
SENTINEL = 1000.0  # exact in every dtype here


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if ON_CPU:
        return None
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (DS_GPU_TESTS_ON_CPU=1 checks this file on the CPU)")
    op = native.load()
    assert op is not None, f"the grad_ops op did not load: {load_error('grad_ops')}"
    return op


def ulp(dtype):
    return torch.finfo(dtype).eps


def tolerance(dtype, magnitude=8.0):
    """One rounding to ``dtype`` of a float32 result of size up to ``magnitude``, with slack for float32."""
    return dict(rtol=2 * ulp(dtype), atol=2 * ulp(dtype) * magnitude)


def random_views(sizes, dtype, aligned, gen, scale=1.0):
    """Tensors of ``sizes``; unaligned ones are views into one buffer at odd offsets, sentinels in between.

    Returns (tensors, check) where ``check()`` asserts that no sentinel changed.
    """
    if aligned:
        tensors = [(torch.randn(n, generator=gen) * scale).to(device=DEVICE, dtype=dtype) for n in sizes]
        return tensors, lambda: None
    gap = 3
    total = sum(sizes) + gap * (len(sizes) + 1)
    buffer = torch.full((total, ), SENTINEL, dtype=dtype, device=DEVICE)
    tensors, offset = [], gap
    for n in sizes:
        view = buffer.narrow(0, offset, n)
        view.copy_(torch.randn(n, generator=gen) * scale)
        tensors.append(view)
        offset += n + gap
    mask = torch.ones(total, dtype=torch.bool, device=DEVICE)
    offset = gap
    for n in sizes:
        mask[offset:offset + n] = False
        offset += n + gap

    def check():
        outside = buffer[mask].float()
        assert torch.all(outside == SENTINEL), "a kernel wrote outside its tensors"

    return tensors, check


def factor_value(kind, value=0.37):
    return torch.tensor(value, device=DEVICE) if kind == "tensor" else value


def f64(tensors):
    return [t.double() for t in tensors]


def pairs():
    return [(d, s) for d in DTYPES for s in DTYPES]


PAIR_IDS = [f"{DTYPE_IDS[d]}<-{DTYPE_IDS[s]}" for d, s in pairs()]


@pytest.mark.parametrize("sizes", list(SIZE_SETS), ids=list(SIZE_SETS))
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "offset"])
@pytest.mark.parametrize("factor_kind", ["float", "tensor"])
@pytest.mark.parametrize("dst_dtype,src_dtype", pairs(), ids=PAIR_IDS)
def test_scale_accumulate(dst_dtype, src_dtype, factor_kind, aligned, sizes):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dst_dtype}{src_dtype}{sizes}".encode()))
    targets, check_targets = random_views(SIZE_SETS[sizes], dst_dtype, aligned, gen)
    grads, check_grads = random_views(SIZE_SETS[sizes], src_dtype, aligned, gen)
    factor = factor_value(factor_kind)
    expected = [t + 0.37 * g for t, g in zip(f64(targets), f64(grads))]
    via_torch = [t.clone() for t in targets]
    grad_ops._TORCH["scale_accumulate"](via_torch, grads, 0.37)
    native.scale_accumulate(targets, grads, factor)
    for got, want, other in zip(targets, expected, via_torch):
        torch.testing.assert_close(got.double(), want, **tolerance(dst_dtype))
        torch.testing.assert_close(got.double(), other.double(), **tolerance(dst_dtype))
    check_targets()
    check_grads()


@pytest.mark.parametrize("sizes", ["odd", "zeros", "many", "large"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["overwrite", "accumulate"])
@pytest.mark.parametrize("factor_kind", ["one", "float", "tensor"])
@pytest.mark.parametrize("out_dtype,grad_dtype", pairs(), ids=PAIR_IDS)
def test_flatten_into(out_dtype, grad_dtype, factor_kind, accumulate, sizes):
    gen = torch.Generator().manual_seed(7)
    grads, check_grads = random_views(SIZE_SETS[sizes], grad_dtype, aligned=sizes != "odd", gen=gen)
    n = sum(SIZE_SETS[sizes])
    tail = 13
    out = torch.randn(n + tail, generator=gen).to(device=DEVICE, dtype=out_dtype)
    before = out.double().clone()
    if not accumulate:
        out.fill_(float("nan"))  # every element must be written
    factor = 1.0 if factor_kind == "one" else factor_value(factor_kind)
    value = 1.0 if factor_kind == "one" else 0.37
    flat = torch.cat([g.double().reshape(-1) for g in grads]) if grads else torch.zeros(0, dtype=torch.float64)
    native.flatten_into(grads, out, factor, accumulate)
    head, rest = out[:n].double(), out[n:].double()
    if accumulate:
        torch.testing.assert_close(head, before[:n] + value * flat.to(DEVICE), **tolerance(out_dtype))
        assert torch.equal(rest, before[n:]), "accumulating must leave the tail alone"
    else:
        torch.testing.assert_close(head, value * flat.to(DEVICE), **tolerance(out_dtype))
        assert torch.all(rest == 0), "the tail must be zeroed"
    check_grads()


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("accumulate", [False, True], ids=["overwrite", "accumulate"])
@pytest.mark.parametrize("rows_dtype,grad_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)],
                         ids=["fp32<-fp32", "fp32<-bf16", "bf16<-bf16", "fp16<-fp32"])
def test_chunk_into(rows_dtype, grad_dtype, accumulate, world):
    gen = torch.Generator().manual_seed(world)
    sizes = [0, 1, 5, 4097, 10, 3 * 4096 + 1]
    grads, check_grads = random_views(sizes, grad_dtype, aligned=False, gen=gen)
    columns = sum(max(1, -(-n // world)) for n in sizes)
    rows = torch.randn(world, columns, generator=gen).to(device=DEVICE, dtype=rows_dtype)
    reference = rows.double().clone()
    grad_ops._TORCH["chunk_into"](f64(grads), reference, 0.37, accumulate)
    if not accumulate:
        rows.fill_(float("nan"))
    native.chunk_into(grads, rows, 0.37, accumulate)
    torch.testing.assert_close(rows.double(), reference, **tolerance(rows_dtype))
    check_grads()


@pytest.mark.parametrize("sizes", list(SIZE_SETS), ids=list(SIZE_SETS))
@pytest.mark.parametrize("unscale_kind", ["none", "float", "tensor"])
@pytest.mark.parametrize("dtype", DTYPES, ids=[DTYPE_IDS[d] for d in DTYPES])
def test_partial_sq_norm(dtype, unscale_kind, sizes):
    gen = torch.Generator().manual_seed(11)
    tensors, check = random_views(SIZE_SETS[sizes], dtype, aligned=sizes != "odd", gen=gen, scale=3.0)
    unscale = None if unscale_kind == "none" else factor_value(unscale_kind, 0.125 if dtype != torch.float32 else 0.3)
    scaled = [t.clone() for t in tensors]
    if unscale is not None:
        grad_ops._TORCH["scale_"](scaled, unscale)
    expected = sum(float(t.double().square().sum()) for t in scaled)
    total = native.partial_sq_norm(tensors, unscale=unscale)
    assert total.dtype == torch.float32 and total.dim() == 0 and total.device.type == DEVICE
    # The kernel sums float32 blocks in double; the torch fallback (CPU mode) squares a float32 norm.
    rtol = 1e-4 if ON_CPU else 1e-5
    assert abs(float(total) - expected) <= rtol * max(expected, 1e-30), (float(total), expected)
    for got, want in zip(tensors, scaled):
        assert torch.equal(got, want), "the in-place unscale differs from torch's"
    again = native.partial_sq_norm(tensors)
    assert torch.equal(again, native.partial_sq_norm(tensors)), "the sum must not depend on the launch"
    check()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", DTYPES, ids=[DTYPE_IDS[d] for d in DTYPES])
def test_partial_sq_norm_non_finite(dtype, bad):
    tensors = [torch.randn(5000, device=DEVICE).to(dtype), torch.randn(77, device=DEVICE).to(dtype)]
    tensors[1][40] = bad
    assert not torch.isfinite(native.partial_sq_norm(tensors))
    assert not torch.isfinite(native.partial_sq_norm(tensors, unscale=0.5))


def test_partial_sq_norm_edges():
    assert float(native.partial_sq_norm([torch.zeros(0, device=DEVICE)])) == 0.0
    assert float(native.partial_sq_norm([])) == 0.0
    total = native.partial_sq_norm([torch.ones(10, device=DEVICE)], device="cpu")
    assert total.device.type == "cpu" and float(total) == 10.0


@pytest.mark.parametrize("sizes", ["odd", "zeros", "many"])
@pytest.mark.parametrize("coef_kind", ["float", "tensor"])
@pytest.mark.parametrize("dtype", DTYPES, ids=[DTYPE_IDS[d] for d in DTYPES])
def test_scale(dtype, coef_kind, sizes):
    gen = torch.Generator().manual_seed(3)
    tensors, check = random_views(SIZE_SETS[sizes], dtype, aligned=sizes != "odd", gen=gen)
    # float32 product, one rounding (torch's own foreach may round a tensor factor to bfloat16 first)
    expected = [(t.float() * torch.tensor(0.37, dtype=torch.float32)).to(dtype) for t in tensors]
    native.scale_(tensors, factor_value(coef_kind))
    for got, want in zip(tensors, expected):
        if ON_CPU:
            torch.testing.assert_close(got, want, **tolerance(dtype))
        else:
            assert torch.equal(got, want)
    check()


@pytest.mark.parametrize("sizes", ["odd", "zeros", "many", "large"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "offset"])
@pytest.mark.parametrize("dst_dtype,src_dtype", pairs(), ids=PAIR_IDS)
def test_cast_copy(dst_dtype, src_dtype, aligned, sizes):
    gen = torch.Generator().manual_seed(5)
    srcs, check_srcs = random_views(SIZE_SETS[sizes], src_dtype, aligned, gen, scale=100.0)
    dsts, check_dsts = random_views(SIZE_SETS[sizes], dst_dtype, aligned, gen)
    for d in dsts:
        d.fill_(float("nan"))
    native.cast_copy(dsts, srcs)
    for got, src in zip(dsts, srcs):
        assert torch.equal(got, src.to(dst_dtype)), "the cast must round as torch's does"
    check_srcs()
    check_dsts()


@pytest.mark.parametrize("sizes", ["one", "odd", "zeros", "many", "large"])
@pytest.mark.parametrize("out_dtype,src_dtype", pairs(), ids=PAIR_IDS)
def test_pack_cast(out_dtype, src_dtype, sizes):
    gen = torch.Generator().manual_seed(9)
    srcs, check = random_views(SIZE_SETS[sizes], src_dtype, aligned=sizes != "odd", gen=gen, scale=10.0)
    out = torch.full((sum(SIZE_SETS[sizes]), ), float("nan"), dtype=out_dtype, device=DEVICE)
    native.pack_cast(srcs, out)
    assert torch.equal(out, torch.cat([s.reshape(-1) for s in srcs]).to(out_dtype))
    check()


def _calls_with(tensor):
    """Each wrapper called with ``tensor`` in the position of a gradient/source."""
    flat = torch.zeros(64, device=DEVICE)
    return {
        "scale_accumulate": lambda: native.scale_accumulate([torch.zeros_like(tensor)], [tensor], 1.0),
        "flatten_into": lambda: native.flatten_into([tensor], flat, 1.0, False),
        "chunk_into": lambda: native.chunk_into([tensor], torch.zeros(2, 16, device=DEVICE), 1.0, False),
        "partial_sq_norm": lambda: native.partial_sq_norm([tensor]),
        "scale_": lambda: native.scale_([tensor], 2.0),
        "cast_copy": lambda: native.cast_copy([torch.zeros(tensor.shape, device=DEVICE)], [tensor]),
        "pack_cast": lambda: native.pack_cast([tensor], torch.zeros(tensor.numel(), device=DEVICE)),
    }


@pytest.mark.skipif(ON_CPU, reason="the torch implementations accept any layout")
@pytest.mark.parametrize("name", native.NAMES)
def test_rejects_non_contiguous(name):
    transposed = torch.randn(4, 8, device=DEVICE).t()
    with pytest.raises(RuntimeError, match="not contiguous"):
        _calls_with(transposed)[name]()


@pytest.mark.skipif(ON_CPU, reason="the torch implementations accept float64")
@pytest.mark.parametrize("name", native.NAMES)
def test_rejects_float64(name):
    with pytest.raises(RuntimeError, match="float32, bfloat16 and float16"):
        _calls_with(torch.randn(32, device=DEVICE, dtype=torch.float64))[name]()


@pytest.mark.skipif(ON_CPU, reason="needs CUDA tensors")
def test_rejects_mixed_devices_and_sizes():
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        native.scale_accumulate([torch.zeros(4, device=DEVICE)], [torch.zeros(4)], 1.0)
    with pytest.raises(RuntimeError, match="elements"):
        native.cast_copy([torch.zeros(4, device=DEVICE)], [torch.zeros(5, device=DEVICE)])
    with pytest.raises(RuntimeError, match="elements"):
        native.pack_cast([torch.zeros(4, device=DEVICE)], torch.zeros(5, device=DEVICE))
    with pytest.raises(RuntimeError, match="columns"):
        native.chunk_into([torch.zeros(4, device=DEVICE)], torch.zeros(2, 3, device=DEVICE), 1.0, False)


@pytest.mark.skipif(ON_CPU, reason="registers the CUDA kernels")
def test_register_replaces_the_torch_functions():
    try:
        assert native.register(DEVICE, names=native.NAMES) == list(native.NAMES)
        for name in native.NAMES:
            assert grad_ops.implementation(name) is native.WRAPPERS[name]
        out = torch.full((10, ), float("nan"), device=DEVICE)
        grad_ops.flatten_into([torch.ones(3, device=DEVICE), torch.ones(4, device=DEVICE)], out, 2.0, False)
        assert out.tolist() == [2.0] * 7 + [0.0] * 3
    finally:
        grad_ops.reset()
    assert grad_ops.implementation("flatten_into") is grad_ops._TORCH["flatten_into"]
