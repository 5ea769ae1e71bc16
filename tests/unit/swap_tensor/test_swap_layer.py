# SPDX-License-Identifier: Apache-2.0
"""The swap layer under the disk tiers, against plain tensors: the page table, the paged store (round trips through
a cache smaller than the data, read-ahead, pages written behind, threads, copies that keep a slot busy, errors),
the swap folder (its checks, its lock, stale files) and upstream's swap helpers (``utils``, ``AsyncTensorSwapper``)."""

import errno
import os
import random
import threading

import pytest
import torch

from deepspeed.ops.aio.async_io import AsyncIOError, aio_handle
from deepspeed.ops.aio.backends import open_io
from deepspeed.runtime.swap_tensor.async_swapper import AsyncTensorSwapper
from deepspeed.runtime.swap_tensor.paged_store import PagedStore, PageTable
from deepspeed.runtime.swap_tensor.swap_folder import SwapConfigError, SwapFolder, check_nvme_path
from deepspeed.runtime.swap_tensor.utils import (SwapBufferManager, SwapBufferPool, get_sized_buffers, swap_in_tensors,
                                                 swap_out_tensors)

FIELDS = {"a": torch.float32, "b": torch.bfloat16}


@pytest.fixture(params=["native", "python"])
def io(request):
    engine = open_io(8192, 2, False, True, 2, backend=None if request.param == "native" else "python")
    yield engine
    engine.close()


def test_page_table():
    table = PageTable([[(10, 5), (0, 10)], [], [(0, 3)]], page_numel=4)
    assert table.pages == [(0, 0, 4), (0, 4, 4), (0, 8, 2), (0, 10, 4), (0, 14, 1), (2, 0, 3)]
    assert table.group_numel == [15, 0, 3] and table.largest == 4
    assert table.covering(0, 3, 9) == [(0, 3, 3, 1), (1, 0, 4, 4), (2, 0, 8, 2), (3, 0, 10, 2)]
    assert table.covering(2, 0, 3) == [(5, 0, 0, 3)]
    with pytest.raises(ValueError, match="gap or overlap"):
        PageTable([[(0, 4), (5, 2)]], 4)


def _store(io, tmp_path, slots, pieces=((0, 37), (37, 20)), page=6):
    table = PageTable([list(pieces), [(0, 11)]], page)
    files = {(g, f): str(tmp_path / f"g{g}.{f}.tensor.swp") for g in range(2) for f in FIELDS}
    return PagedStore(table, FIELDS, files, io, slots, pin=False), table


def _fill(store, table, values):
    for page, (g, start, length) in enumerate(table.pages):
        view = store.acquire(page, read=False, modify=True)
        for name in FIELDS:
            view.fields[name].copy_(values[(g, name)].narrow(0, start, length))
        store.release(page, dirty=True)


def _values(table, seed):
    gen = torch.Generator().manual_seed(seed)
    return {
        (g, name): torch.randn(n, generator=gen).to(dtype)
        for g, n in enumerate(table.group_numel)
        for name, dtype in FIELDS.items()
    }


def test_store_round_trip_through_a_small_cache(io, tmp_path):
    store, table = _store(io, tmp_path, slots=3)
    values = _values(table, 0)
    _fill(store, table, values)
    store.flush()
    order = list(range(len(table.pages)))
    random.Random(0).shuffle(order)
    for i, page in enumerate(order):
        store.prefetch(order[i + 1:i + 2])
        view = store.acquire(page)
        g, start, length = table.pages[page]
        for name in FIELDS:
            assert torch.equal(view.fields[name], values[(g, name)].narrow(0, start, length)), (page, name)
        store.release(page)
    assert store.stats["reads"] >= len(table.pages) - 3  # the cache holds 3 of 13 pages
    # a step: every page modified and written behind; then read back cold
    for page, (g, start, length) in enumerate(table.pages):
        view = store.acquire(page, modify=True)
        view.fields["a"].mul_(2)
        store.release(page, dirty=True)
        values[(g, "a")].narrow(0, start, length).mul_(2)
    store.drop_cache()
    assert store.cached_pages() == []
    for page, (g, start, length) in enumerate(table.pages):
        view = store.acquire(page)
        assert torch.equal(view.fields["a"], values[(g, "a")].narrow(0, start, length))
        store.release(page)


@pytest.mark.parametrize("slots,ahead_first", [(3, True), (4, True), (4, False), (5, True)])
def test_read_ahead_never_evicts_the_pages_about_to_be_used(io, tmp_path, slots, ahead_first):
    """A pass over every page in the planned order (each page read ahead past, taken, modified, written behind, as
    the optimizer tier steps) reads each page once: the read-ahead may not evict the page about to be taken or the
    pages it reads for (they are the least recently used ones). It read the stepped page twice before (1.88 reads
    a page with 4 slots: docs/performance.md, "NVMe offload")."""
    store, table = _store(io, tmp_path, slots=slots)
    values = _values(table, 1)
    _fill(store, table, values)
    store.flush()
    store.drop_cache()
    order = list(range(len(table.pages)))
    window = max(1, slots - 2)
    for step in range(3):
        before = store.stats["reads"]
        for i, page in enumerate(order):
            if ahead_first:
                store.prefetch(order[i + 1:i + 1 + window], keep=(page, ))
            view = store.acquire(page, modify=True)
            if not ahead_first:
                store.prefetch(order[i + 1:i + 1 + window], keep=(page, ))
            view.fields["a"].add_(1.0)
            store.release(page, dirty=True)
        store.flush()
        # the first pass reads every page; later ones re-read only what the small cache could not keep (all of it)
        assert store.stats["reads"] - before == len(table.pages), (step, store.stats["reads"] - before)
    store.drop_cache()
    for page, (g, start, length) in enumerate(table.pages):  # and the values are right: three increments
        view = store.acquire(page)
        expected = values[(g, "a")].narrow(0, start, length).clone()
        for _ in range(3):
            expected.add_(1.0)
        assert torch.equal(view.fields["a"], expected)
        store.release(page)


def test_store_threads(io, tmp_path):
    store, table = _store(io, tmp_path, slots=4, page=3)
    values = _values(table, 1)
    _fill(store, table, values)
    failures = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(60):
                page = rng.randrange(len(table.pages))
                view = store.acquire(page)
                g, start, length = table.pages[page]
                if not torch.equal(view.fields["b"], values[(g, "b")].narrow(0, start, length)):
                    failures.append(page)
                store.release(page)
        except Exception as error:
            failures.append(error)

    threads = [threading.Thread(target=worker, args=(k, )) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and not failures


class _SlowCopy:
    """A device copy still reading a slot until ``done`` is set."""

    def __init__(self):
        self.event = threading.Event()
        self.waited = False

    def synchronize(self):
        self.waited = True
        self.event.wait(10)

    def done(self):
        return self.event.is_set()


def test_busy_slot_waits_for_its_copy(io, tmp_path):
    store, table = _store(io, tmp_path, slots=1)
    _fill(store, table, _values(table, 2))
    store.flush()
    copy = _SlowCopy()
    store.acquire(0)
    store.release(0, busy=copy)
    store.prefetch([1])  # a prefetch never takes a busy slot
    assert store.cached_pages() == [0] and not copy.waited
    threading.Timer(0.05, copy.event.set).start()
    store.acquire(1)  # evicting page 0 waits for the copy that reads its slot
    assert copy.waited and copy.done()
    store.release(1)


def test_store_errors(io, tmp_path):
    store, table = _store(io, tmp_path, slots=2)
    with pytest.raises(RuntimeError, match="read before it was ever written"):
        store.acquire(0)
    values = _values(table, 3)
    _fill(store, table, values)
    store.drop_cache()
    io.inject_fault(0, 0, errno.EIO)  # every read fails
    with pytest.raises(AsyncIOError, match=r"read from .*g0\.a\.tensor\.swp .*\(errno 5\)"):
        store.acquire(0)
    assert store.cached_pages() == []  # the failed page is not handed out later
    io.inject_fault(0, 0, 0)
    view = store.acquire(0)
    assert torch.equal(view.fields["a"], values[(0, "a")].narrow(0, 0, 6))
    store.release(0)
    io.inject_fault(1, 0, errno.ENOSPC)  # a full disk: the write-back fails, and says so
    view = store.acquire(1, modify=True)
    store.release(1, dirty=True)
    with pytest.raises(AsyncIOError, match="errno 28"):
        store.flush()


def test_swap_folder(tmp_path):
    with pytest.raises(SwapConfigError, match="'k.nvme_path' is required"):
        check_nvme_path(None, "k.nvme_path")
    with pytest.raises(SwapConfigError, match="does not exist"):
        check_nvme_path(str(tmp_path / "missing"), "k")
    (tmp_path / "file").write_text("x")
    with pytest.raises(SwapConfigError, match="is not a folder"):
        check_nvme_path(str(tmp_path / "file"), "k")
    with pytest.raises(SwapConfigError, match="cannot create"):
        SwapFolder(str(tmp_path / "file" / "rank0"), "k")
    path = str(tmp_path / "rank0")
    os.makedirs(path)
    stale = os.path.join(path, "group0.fp32.tensor.swp")
    with open(stale, "wb") as f:
        f.write(b"a killed run's state")
    folder = SwapFolder(path, "k")
    assert not os.path.exists(stale)  # never read as current
    with pytest.raises(SwapConfigError, match=f"in use by pid {os.getpid()}"):
        SwapFolder(path, "k")
    with pytest.raises(SwapConfigError, match="need .* GB .* are free"):
        folder.reserve({folder.file("huge"): 1 << 62})
    folder.reserve({folder.file("x"): 12288})
    assert os.path.getsize(folder.file("x")) == 12288
    folder.close()
    assert not os.path.exists(folder.file("x"))
    SwapFolder(path, "k").close()  # free again


def test_upstream_swap_helpers(tmp_path):
    handle = aio_handle(4096, 2, False, True, 1)
    example = torch.empty(0, dtype=torch.float32)
    manager = SwapBufferManager(num_elems=2048, count=3, dtype=torch.float32)
    buffers = manager.allocate(2048, 2, torch.float32)
    assert manager.allocate(2048, 2, torch.float32) is None
    pool = SwapBufferPool(buffers, handle)
    tensors = [torch.randn(n) for n in (1000, 900, 700)]
    paths = [str(tmp_path / f"t{i}.swp") for i in range(3)]
    for tensor, path in zip(tensors, paths):
        swap, compute = pool.insert_tensor(tensor, path, 1024 * -(-tensor.numel() // 1024))
        assert swap is not None and torch.equal(compute, tensor)
    pool.swap_out(handle)
    for compute in pool.get_compute_tensors():
        compute.zero_()
    pool.swap_in(handle)
    assert all(torch.equal(c, t) for c, t in zip(pool.get_compute_tensors(), tensors))
    assert pool.allocate_tensor(4096, "x", 4096) == (None, None)
    manager.free(buffers)
    reads = get_sized_buffers([handle.new_cpu_locked_tensor(1024, example) for _ in paths], [1024] * 3)
    swap_in_tensors(handle, reads, paths)
    assert handle.wait() == 3 and torch.equal(reads[1][:900], tensors[1])
    swap_out_tensors(handle, reads, paths)
    assert handle.wait() == 3
    swapper = AsyncTensorSwapper(handle, numel_alignment=1024)
    swapper.add_buffers([handle.new_cpu_locked_tensor(2048, example) for _ in range(2)])
    outs = [str(tmp_path / f"o{i}.swp") for i in range(3)]
    swapper.swap_out_tensors(tensors, outs)
    assert len(swapper.release_buffers()) == 2 and not swapper.has_buffers()
    for tensor, path in zip(tensors, outs):
        back = torch.empty_like(tensor)
        handle.sync_pread(back, path)
        assert torch.equal(back, tensor)
    with pytest.raises(ValueError, match="new_cpu_locked_tensor"):
        SwapBufferPool([torch.empty(3)[1:]], handle)


class _SlowWrites:
    """An aio engine whose writes complete only when ``release`` is set (reads run at once)."""

    def __init__(self, io):
        self.io = io
        self.release = threading.Event()
        self.writes = set()

    def submit(self, write, *args):
        request = self.io.submit(write, *args)
        if write:
            self.writes.add(request)
        return request

    def wait_op(self, request_id):
        if request_id in self.writes:
            self.release.wait(10)
        self.io.wait_op(request_id)

    def is_done(self, request_id):
        return (request_id not in self.writes or self.release.is_set()) and self.io.is_done(request_id)


def test_evicted_page_is_read_after_its_write(io, tmp_path):
    slow = _SlowWrites(io)
    table = PageTable([[(0, 8)], [(0, 8)]], 4)  # pages 0, 1 (group 0), 2, 3 (group 1)
    files = {(g, f): str(tmp_path / f"w{g}.{f}.tensor.swp") for g in range(2) for f in FIELDS}
    store = PagedStore(table, FIELDS, files, slow, 2, pin=False)
    slow.release.set()
    _fill(store, table, _values(table, 4))
    store.flush()
    slow.release.clear()
    view = store.acquire(0, modify=True)
    view.fields["a"].fill_(7)
    store.release(0, dirty=True)  # its write waits for ``release``
    store.release(store.acquire(3).index)  # page 0 is now the least recently used
    evicting = threading.Thread(target=lambda: store.release(store.acquire(1).index))  # evicts page 0: waits
    evicting.start()
    evicting.join(0.2)
    got = {}

    def reread():  # page 0 again, in the other slot: the file holds it only once its write completed
        got["a"] = store.acquire(0).fields["a"].clone()
        store.release(0)

    reading = threading.Thread(target=reread)
    reading.start()
    reading.join(0.2)
    assert evicting.is_alive() and reading.is_alive()
    slow.release.set()
    evicting.join(10)
    reading.join(10)
    assert torch.equal(got["a"], torch.full((4, ), 7.0))


def test_aio_section_reaches_the_tiers():
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
    from deepspeed.runtime.zero.stages import StageConfig
    zero = {
        "stage": 3,
        "sub_group_size": 123,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/x"
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/y",
            "buffer_size": 77,
            "max_in_cpu": 770
        }
    }
    for aio, lanes in (({"thread_count": 3}, 3), ({"intra_op_parallelism": 5, "queue_depth": 16}, 5), ({}, 1)):
        cfg = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, "aio": aio})
        stage = StageConfig.from_ds_config(cfg, torch.bfloat16)
        assert stage.offload_optimizer == stage.offload_param == "cpu"  # the host tier under the disk tier
        for tier in (stage.optimizer_swap, stage.param_swap):
            assert tier.aio.intra_op_parallelism == lanes and tier.aio.queue_depth == aio.get("queue_depth", 8)
        assert (stage.optimizer_swap.page_numel, stage.optimizer_swap.buffer_count) == (123, 4)
        assert (stage.param_swap.page_numel, stage.param_swap.slots(77)) == (77, 10)
        assert get_aio_config({"aio": aio})["intra_op_parallelism"] == lanes
