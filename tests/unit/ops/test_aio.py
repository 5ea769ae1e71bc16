# SPDX-License-Identifier: Apache-2.0
"""The aio handle (``AsyncIOBuilder().load().aio_handle``) on both engines, against plain Python file I/O.

Round trips of odd sizes at odd and aligned offsets, sync and async, pieces composing one file, every dtype width;
``wait()`` counts (0 with nothing queued); many requests from several threads; a constant number of open files over
thousands of requests; the GIL released while a caller waits; the errors: a missing file, a short read, a full disk
and a file system that refuses ``O_DIRECT`` (injected faults), each raised as ``AsyncIOError`` naming the file; the
tools ``ds_io`` and ``ds_nvme_tune``.
"""

import errno
import os
import threading

import pytest
import torch

from deepspeed.ops.aio.async_io import AsyncIOError, aio_handle
from deepspeed.ops.aio.backends import ALIGNMENT, native_op
from deepspeed.ops.aio.buffers import aligned_empty, aligned_numel, is_aligned
from deepspeed.ops.op_builder import AsyncIOBuilder

BACKENDS = ["native", "python"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "native" and native_op() is None:
        pytest.skip("the async_io op cannot be built here (no C++ compiler)")
    return request.param


def _handle(backend, **kwargs):
    args = dict(block_size=4096, queue_depth=2, single_submit=False, overlap_events=True, intra_op_parallelism=2)
    args.update(kwargs)
    return aio_handle(**args, backend=backend)


def _bytes(path, offset, length):
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _random(numel, dtype=torch.float32, aligned=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0,
                           256, (numel * torch.empty((), dtype=dtype).element_size(), ),
                           generator=gen,
                           dtype=torch.uint8)
    out = aligned_empty(values.numel(), torch.uint8) if aligned else torch.empty_like(values)
    return out.copy_(values).view(dtype)


def test_builder_loads_upstream_module():
    module = AsyncIOBuilder().load()
    handle = module.aio_handle()
    assert (handle.get_block_size(), handle.get_queue_depth(), handle.get_single_submit(), handle.get_overlap_events(),
            handle.get_intra_op_parallelism()) == (1 << 20, 128, False, False, 1)
    assert handle.get_alignment() == ALIGNMENT and handle.wait() == 0
    assert callable(module.aio_read) and callable(module.aio_write) and callable(module.deepspeed_memcpy)
    assert AsyncIOBuilder().is_compatible() == (native_op() is not None)


@pytest.mark.parametrize("nbytes,offset,aligned", [(1, 0, False), (4095, 13, False), (4096, 0, True),
                                                   (4096 * 3 + 7, 4096, True), ((1 << 20) + 13, 4096 * 5, True),
                                                   (12288, 4096, False)])
def test_round_trip_sync_and_async(backend, tmp_path, nbytes, offset, aligned):
    handle = _handle(backend)
    path = str(tmp_path / "f.bin")
    data = _random(nbytes, torch.uint8, aligned=aligned, seed=nbytes)
    assert handle.sync_pwrite(data, path, offset) == 1
    assert _bytes(path, offset, nbytes) == data.numpy().tobytes()
    back = aligned_empty(nbytes, torch.uint8) if aligned else torch.empty(nbytes, dtype=torch.uint8)
    assert handle.sync_pread(back, path, offset) == 1
    assert torch.equal(back, data)
    back.zero_()
    assert handle.async_pread(back, path, offset) == 0
    assert handle.wait() == 1 and handle.wait() == 0
    assert torch.equal(back, data)
    assert handle.read(back, path, True, offset) == 0 and handle.write(data, path, True, offset) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_pieces_compose_one_file(backend, tmp_path, dtype):
    handle = _handle(backend, block_size=8192, queue_depth=4)
    path = str(tmp_path / "pieces.bin")
    whole = _random(3 * 4096 + 100, dtype, aligned=True, seed=3)
    step = aligned_numel(1500, dtype)  # aligned piece starts in the file
    starts = list(range(0, whole.numel(), step))
    for start in reversed(starts):  # written in any order, asynchronously
        piece = whole.narrow(0, start, min(step, whole.numel() - start)).clone()
        assert handle.pwrite(piece, path, False, True, start * whole.element_size()) == 0
    assert handle.wait() == len(starts)
    back = aligned_empty(whole.numel(), dtype)
    handle.pread(back, path, True, False)
    assert torch.equal(back.view(torch.uint8), whole.view(torch.uint8))
    pieces = [torch.empty(min(step, whole.numel() - s), dtype=dtype) for s in starts]
    for start, piece in zip(starts, pieces):
        handle.async_pread(piece, path, start * whole.element_size())
    assert handle.wait() == len(starts)
    assert torch.equal(torch.cat(pieces).view(torch.uint8), whole.view(torch.uint8))


def test_write_to_an_open_descriptor(backend, tmp_path):
    handle = _handle(backend)
    data = _random(5000, torch.uint8, seed=9)
    fd = os.open(tmp_path / "fd.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert handle.async_pwrite(data, fd, 4096) == 0
        assert handle.wait() == 1
        os.fstat(fd)  # still open: the caller's descriptor is never closed
        assert os.pread(fd, 5000, 4096) == data.numpy().tobytes()
    finally:
        os.close(fd)


def test_locked_tensors_and_memcpy(backend):
    handle = _handle(backend)
    example = torch.empty(0, dtype=torch.bfloat16)
    tensor = handle.new_cpu_locked_tensor(1000, example)
    assert tensor.dtype == torch.bfloat16 and tensor.numel() == 1000 and is_aligned(tensor)
    assert handle.is_pinned(tensor)
    source = torch.randn(1000).to(torch.bfloat16)
    assert AsyncIOBuilder().load().deepspeed_memcpy(tensor, source) == 0
    assert torch.equal(tensor, source)
    assert handle.free_cpu_locked_tensor(tensor)


def test_many_requests_from_threads(backend, tmp_path):
    handle = _handle(backend, queue_depth=4)
    failures = []

    def worker(k):
        try:
            for i in range(20):
                data = _random(4096 * (1 + (i % 3)) + k, torch.uint8, seed=100 * k + i)
                path = str(tmp_path / f"t{k}_{i % 4}.bin")
                handle.sync_pwrite(data, path)
                back = torch.empty_like(data)
                handle.sync_pread(back, path)
                if not torch.equal(back, data):
                    failures.append((k, i))
        except Exception as error:  # reported below
            failures.append(error)

    threads = [threading.Thread(target=worker, args=(k, )) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a request never completed"
    assert not failures and handle.pending() == 0


def test_open_files_constant(backend, tmp_path):
    handle = _handle(backend, queue_depth=8)
    data = _random(8192, torch.uint8, aligned=True)
    path = str(tmp_path / "fds.bin")
    handle.sync_pwrite(data, path)
    before = len(os.listdir("/proc/self/fd"))
    for round_ in range(10 if backend == "native" else 5):  # 2,000 requests (1,000 on Python threads)
        for i in range(200):
            if i % 2:
                handle.async_pwrite(data, path)
            else:
                handle.async_pread(torch.empty_like(data), path)
        assert handle.wait() == 200
    assert len(os.listdir("/proc/self/fd")) == before


def test_wait_releases_the_gil(backend, tmp_path):
    handle = _handle(backend, block_size=1 << 16, queue_depth=1, intra_op_parallelism=1)
    # native: 128 blocks one after another; python: 32 (its I/O threads need the GIL for each block)
    data = _random((8 if backend == "native" else 2) << 20, torch.uint8, aligned=True)
    path = str(tmp_path / "gil.bin")
    handle.sync_pwrite(data, path)
    counter = 0
    inside = threading.Event()
    done = threading.Event()

    def read():
        inside.set()
        handle.sync_pread(data, path)
        done.set()

    thread = threading.Thread(target=read)
    thread.start()
    inside.wait()  # returns once this thread holds the GIL again: while the read waits, unless the wait kept it
    while not done.is_set():
        counter += 1
    thread.join()
    assert counter > 10, "the main thread could not run while another waited on the handle"


def test_errors(backend, tmp_path):
    handle = _handle(backend)
    data = _random(10000, torch.uint8)
    with pytest.raises(AsyncIOError, match="cannot open .*missing"):
        handle.async_pread(data, str(tmp_path / "missing" / "f.bin"))
    path = str(tmp_path / "short.bin")
    handle.sync_pwrite(data[:5000], path)
    with pytest.raises(AsyncIOError, match="short read from .*short.bin: the file ends at byte 5000"):
        handle.sync_pread(data, path)
    handle.async_pread(data, path)
    with pytest.raises(AsyncIOError, match="short read"):
        handle.wait()
    assert handle.wait() == 0  # reported once
    with pytest.raises(ValueError, match="contiguous"):
        handle.sync_pwrite(torch.zeros(4, 4).t(), path)


def test_injected_faults(backend, tmp_path):
    handle = _handle(backend, intra_op_parallelism=1, queue_depth=1)
    data = _random(4 * 4096, torch.uint8, aligned=True)
    handle._io.inject_fault(1, 2, errno.ENOSPC)  # the third write block fails: a disk that fills
    path = str(tmp_path / "full.bin")
    with pytest.raises(AsyncIOError, match=r"write to .*full.bin at byte 8192 failed: .*\(errno 28\)") as caught:
        handle.sync_pwrite(data, path)
    assert caught.value.errno == errno.ENOSPC
    handle._io.inject_fault(2, 0, errno.EINVAL)  # a file system that refuses O_DIRECT: buffered, counted
    handle._io.inject_fault(2, 0, errno.EINVAL)
    handle.sync_pwrite(data, path)
    back = aligned_empty(data.numel(), torch.uint8)
    handle.sync_pread(back, path)
    assert torch.equal(back, data) and handle.direct_refused() == 2


def test_aio_inject_fault_env(monkeypatch, backend, tmp_path):
    monkeypatch.setenv("DS_AIO_INJECT_FAULT", "read:0:5")
    handle = _handle(backend)
    data = _random(4096, torch.uint8)
    path = str(tmp_path / "env.bin")
    handle.sync_pwrite(data, path)
    with pytest.raises(AsyncIOError, match="errno 5"):
        handle.sync_pread(data, path)
    monkeypatch.setenv("DS_AIO_INJECT_FAULT", "sideways:1:2")
    with pytest.raises(ValueError, match="DS_AIO_INJECT_FAULT"):
        _handle(backend)


def test_ds_io_and_nvme_tune(tmp_path, capsys):
    from deepspeed.nvme import ds_io_main, nvme_tune_main
    assert ds_io_main([
        "--folder",
        str(tmp_path), "--io_size", "256K", "--loops", "1", "--warmup_loops", "0", "--validate", "--json"
    ]) == 0
    out = capsys.readouterr().out
    assert "Write speed:" in out and "Read  speed:" in out and '"direct_refused": 0' in out
    assert ds_io_main(["--folder", str(tmp_path / "missing"), "--io_size", "1M"]) == 2
    sweep = tmp_path / "sweep.json"
    sweep.write_text('{"block_size": ["64K"], "queue_depth": [1, 4], "intra_op_parallelism": [1]}')
    assert nvme_tune_main([
        "--nvme_dir",
        str(tmp_path), "--io_size", "256K", "--sweep_config",
        str(sweep), "--log_dir",
        str(tmp_path / "logs")
    ]) == 0
    out = capsys.readouterr().out
    assert out.count("| " + str(tmp_path) + " | 65536 |") == 2 and '"aio": {' in out and "best read" in out
    assert not [f for f in os.listdir(tmp_path) if f.startswith("ds_io_")]  # the measurement files are removed
