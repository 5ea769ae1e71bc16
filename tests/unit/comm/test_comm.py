# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.comm`` across two real gloo processes, against the plain arithmetic of the inputs.

One spawn runs every check (spawning torch costs seconds); each check is then
reported as its own test. Every rank builds every rank's input from its rank
number, so each rank computes the expected result itself. Fallback paths are
forced per group and the native collective they replace is replaced by a spy
that fails if called, so a fallback check cannot pass through the native path.
"""

import contextlib
import datetime
import json
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from deepspeed.comm import fallbacks
from deepspeed.comm.env import free_port

WORLD_SIZE = 2
SPAWN_TIMEOUT_S = 180


def _inputs(rank, numel=8, dtype=torch.float32):
    return (torch.arange(numel, dtype=torch.float64) * (rank + 1) + 10 * rank).to(dtype)


def _sum_of_inputs(numel=8, dtype=torch.float32):
    return sum(_inputs(r, numel, torch.float64) for r in range(WORLD_SIZE)).to(dtype)


@contextlib.contextmanager
def _forced(group=None, **flags):
    """Pretend ``group``'s backend lacks the named capabilities."""
    caps = fallbacks.capabilities(group)
    saved = {name: getattr(caps, name) for name in flags}
    for name, value in flags.items():
        setattr(caps, name, value)
    try:
        yield caps
    finally:
        for name, value in saved.items():
            setattr(caps, name, value)


@contextlib.contextmanager
def _replaced(name, replacement):
    """Replace the native collective ``name`` where comm.py and fallbacks.py look it up."""
    import deepspeed.comm.comm as comm_module
    saved = [(module, getattr(module, name)) for module in (comm_module, fallbacks)]
    for module, _ in saved:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, original in saved:
            setattr(module, name, original)


def _must_not_call(name):

    def spy(*args, **kwargs):
        raise AssertionError(f"native {name} called although the fallback was forced")

    return _replaced(name, spy)


@contextlib.contextmanager
def _no_avg_reaches_backend():
    import torch.distributed as dist
    original = dist.all_reduce

    def spy(tensor, op=dist.ReduceOp.SUM, **kwargs):
        assert op != dist.ReduceOp.AVG, "AVG reached the backend although the AVG fallback was forced"
        return original(tensor, op=op, **kwargs)

    dist.all_reduce = spy
    try:
        yield
    finally:
        dist.all_reduce = original


_MISMATCHES = []


def _expect_close(actual, expected):
    """Record a mismatch instead of raising, so that every rank still issues the check's remaining collectives."""
    try:
        torch.testing.assert_close(actual, expected)
    except AssertionError:
        _MISMATCHES.append(traceback.format_exc())


def _maybe_wait(work, async_op):
    if async_op:
        assert work is not None and hasattr(work, "wait")
        work.wait()
    else:
        assert work is None


# ---- checks (run in every worker) ------------------------------------------------------------------


def check_single_process_init(rank):
    """With no launcher variables, init_distributed builds a one-process group on 127.0.0.1."""
    import deepspeed.comm as dist
    assert dist.get_world_size() == 1 and dist.get_rank() == 0
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["WORLD_SIZE"] == "1"
    t = _inputs(rank)
    dist.all_reduce(t)
    _expect_close(t, _inputs(rank))


def check_init_from_env(rank):
    import deepspeed.comm as dist
    assert dist.is_initialized() and dist.is_available()
    assert dist.get_rank() == rank and dist.get_world_size() == WORLD_SIZE
    assert dist.get_local_rank() == rank
    assert dist.get_backend() == "gloo"
    group = dist.get_world_group()
    dist.init_distributed()  # already initialised: a no-op
    assert dist.get_world_group() is group


def check_all_reduce(rank):
    import deepspeed.comm as dist
    for async_op in (False, True):
        t = _inputs(rank)
        _maybe_wait(dist.all_reduce(t, async_op=async_op), async_op)
        _expect_close(t, _sum_of_inputs())
        t = _inputs(rank)
        _maybe_wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=async_op), async_op)
        _expect_close(t, torch.maximum(_inputs(0), _inputs(1)))


def check_all_reduce_avg_fallback(rank):
    import deepspeed.comm as dist
    with _forced(avg=False), _no_avg_reaches_backend():
        for async_op in (False, True):
            t = _inputs(rank)
            _maybe_wait(dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=async_op), async_op)
            _expect_close(t, _sum_of_inputs() / WORLD_SIZE)


def check_reduce(rank):
    import deepspeed.comm as dist
    t = _inputs(rank)
    dist.reduce(t, dst=1)
    if rank == 1:
        _expect_close(t, _sum_of_inputs())
    with _forced(avg=False), _no_avg_reaches_backend():
        t = _inputs(rank)
        dist.reduce(t, dst=0, op=dist.ReduceOp.AVG)
        if rank == 0:
            _expect_close(t, _sum_of_inputs() / WORLD_SIZE)


def check_broadcast(rank):
    import deepspeed.comm as dist
    t = _inputs(rank)
    dist.broadcast(t, src=1)
    _expect_close(t, _inputs(1))


def check_all_gather(rank):
    import deepspeed.comm as dist
    out = [torch.empty(8) for _ in range(WORLD_SIZE)]
    dist.all_gather(out, _inputs(rank))
    for r in range(WORLD_SIZE):
        _expect_close(out[r], _inputs(r))


def _check_all_gather_into_tensor(rank):
    import deepspeed.comm as dist
    expected = torch.cat([_inputs(r).view(2, 4) for r in range(WORLD_SIZE)])
    for async_op in (False, True):
        out = torch.full((WORLD_SIZE * 2, 4), -1.0)
        _maybe_wait(dist.all_gather_into_tensor(out, _inputs(rank).view(2, 4), async_op=async_op), async_op)
        _expect_close(out, expected)
    out = torch.empty(WORLD_SIZE * 8, dtype=torch.bfloat16)
    dist.allgather_fn(out, _inputs(rank, dtype=torch.bfloat16))
    _expect_close(out, expected.view(-1).bfloat16())


def check_all_gather_into_tensor(rank):
    _check_all_gather_into_tensor(rank)


def check_all_gather_into_tensor_fallback(rank):
    with _forced(all_gather_into_tensor=False), _must_not_call("all_gather_single"):
        _check_all_gather_into_tensor(rank)


def _check_reduce_scatter_tensor(rank):
    import deepspeed.comm as dist
    chunk = 4
    expected = _sum_of_inputs().view(WORLD_SIZE, chunk)[rank]
    for async_op in (False, True):
        out = torch.full((chunk, ), -1.0)
        _maybe_wait(dist.reduce_scatter_tensor(out, _inputs(rank), async_op=async_op), async_op)
        _expect_close(out, expected)
        out = torch.full((2, 2), -1.0)
        work = dist.reduce_scatter_tensor(out, _inputs(rank).view(4, 2), op=dist.ReduceOp.AVG, async_op=async_op)
        _maybe_wait(work, async_op)
        _expect_close(out.view(-1), expected / WORLD_SIZE)
    out = torch.empty(chunk)
    dist.reduce_scatter_fn(out, _inputs(rank))
    _expect_close(out, expected)


def check_reduce_scatter_tensor(rank):
    _check_reduce_scatter_tensor(rank)


def check_reduce_scatter_tensor_fallback(rank):
    import deepspeed.comm as dist
    with _forced(reduce_scatter_tensor=False), _must_not_call("reduce_scatter_single"):
        _check_reduce_scatter_tensor(rank)
        out = torch.empty(4)
        work = dist.reduce_scatter_tensor(out, _inputs(rank), async_op=True)
        (result, ) = work.get_future().wait()
        assert result is out
        _expect_close(out, _sum_of_inputs().view(WORLD_SIZE, 4)[rank])
    with _forced(reduce_scatter_tensor=False, avg=False), _must_not_call("reduce_scatter_single"), \
            _no_avg_reaches_backend():
        _check_reduce_scatter_tensor(rank)


def check_reduce_scatter_tensor_avg_fallback(rank):
    with _forced(avg=False), _no_avg_reaches_backend():
        _check_reduce_scatter_tensor(rank)


def _check_reduce_scatter_list(rank):
    import deepspeed.comm as dist
    pieces = [_inputs(rank, 12)[:5], _inputs(rank, 12)[5:10]]
    expected = _sum_of_inputs(12)[5 * rank:5 * rank + 5]
    for async_op in (False, True):
        out = torch.full((5, ), -1.0)
        _maybe_wait(dist.reduce_scatter(out, [p.clone() for p in pieces], async_op=async_op), async_op)
        _expect_close(out, expected)


def check_reduce_scatter_list(rank):
    _check_reduce_scatter_list(rank)


def check_reduce_scatter_list_fallback(rank):
    import torch.distributed

    def spy(*args, **kwargs):
        raise AssertionError("native reduce_scatter called although the fallback was forced")

    original = torch.distributed.reduce_scatter
    torch.distributed.reduce_scatter = spy
    try:
        with _forced(reduce_scatter=False):
            _check_reduce_scatter_list(rank)
    finally:
        torch.distributed.reduce_scatter = original


def check_refusal_is_learned(rank):
    """A backend refusal switches the group to the fallback for good; any other error propagates."""
    import deepspeed.comm as dist
    group = dist.new_group(list(range(WORLD_SIZE)))
    calls = []

    def refusing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("Backend gloo does not support reduce_scatter_tensor")

    expected = _sum_of_inputs().view(WORLD_SIZE, 4)[rank]
    dist.peer_failure.set_watched_waits(False)  # watched waits (docs/faults.md) never use the native reduce-scatter
    try:
        with _replaced("reduce_scatter_single", refusing):
            for _ in range(2):
                out = torch.empty(4)
                dist.reduce_scatter_tensor(out, _inputs(rank), group=group)
                _expect_close(out, expected)
    finally:
        dist.peer_failure.set_watched_waits(None)
    assert len(calls) == 1, "the refusal must be remembered for the group"
    assert not fallbacks.capabilities(group).reduce_scatter_tensor
    assert fallbacks.capabilities(None).reduce_scatter_tensor, "other groups must keep the native path"

    def failing(*args, **kwargs):
        raise RuntimeError("input tensor has the wrong size")

    other = dist.new_group(list(range(WORLD_SIZE)))
    with _replaced("all_gather_single", failing):
        try:
            dist.all_gather_into_tensor(torch.empty(16), _inputs(rank), group=other)
        except RuntimeError as err:
            assert "wrong size" in str(err)
        else:
            raise AssertionError("a real failure must propagate")
    assert fallbacks.capabilities(other).all_gather_into_tensor


def check_all_to_all_single(rank):
    import deepspeed.comm as dist
    out = torch.empty(8)
    dist.all_to_all_single(out, _inputs(rank))
    expected = torch.cat([_inputs(r)[4 * rank:4 * rank + 4] for r in range(WORLD_SIZE)])
    _expect_close(out, expected)


def check_point_to_point(rank):
    import deepspeed.comm as dist
    peer = 1 - rank
    if rank == 0:
        dist.send(_inputs(rank), dst=peer)
        received = torch.empty(8)
        dist.irecv(received, src=peer).wait()
    else:
        received = torch.empty(8)
        dist.recv(received, src=peer)
        dist.isend(_inputs(rank), dst=peer).wait()
    _expect_close(received, _inputs(peer))


def check_all_reduce_coalesced(rank):
    import deepspeed.comm as dist
    tensors = [_inputs(rank, 3), _inputs(rank, 5, torch.float64), _inputs(rank, 2).view(1, 2)]
    dist.all_reduce_coalesced(tensors)
    _expect_close(tensors[0], _sum_of_inputs(3))
    _expect_close(tensors[1], _sum_of_inputs(5, torch.float64))
    _expect_close(tensors[2], _sum_of_inputs(2).view(1, 2))
    tensors = [_inputs(rank, 3)]
    with _forced(avg=False), _no_avg_reaches_backend():
        dist.all_reduce_coalesced(tensors, op=dist.ReduceOp.AVG, async_op=True).wait()
    _expect_close(tensors[0], _sum_of_inputs(3) / WORLD_SIZE)


def check_groups(rank):
    import deepspeed.comm as dist
    only_last = dist.new_group([WORLD_SIZE - 1])
    if rank == WORLD_SIZE - 1:
        assert dist.get_world_size(only_last) == 1 and dist.get_rank(only_last) == 0
        assert dist.get_global_rank(only_last, 0) == WORLD_SIZE - 1
        assert dist.get_all_ranks_from_group(only_last) == [WORLD_SIZE - 1]
    assert dist.get_global_rank(None, 1) == 1
    assert dist.get_all_ranks_from_group() == list(range(WORLD_SIZE))


def check_barriers_and_objects(rank):
    import deepspeed.comm as dist
    dist.barrier()
    dist.monitored_barrier()
    objects = [{"rank": rank}]
    dist.broadcast_object_list(objects, src=1)
    assert objects == [{"rank": 1}]
    gathered = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, rank * 3)
    assert gathered == [r * 3 for r in range(WORLD_SIZE)]
    assert dist.has_all_gather_into_tensor() and dist.has_reduce_scatter_tensor()
    dist.configure(enabled=True)
    assert dist.log_summary() is None


def check_destroy_forgets_mesh(rank):
    """destroy_process_group() drops the mesh's groups (through the teardown hook the mesh registers): no group
    made for the old default group outlives it. Runs last: it destroys the default group."""
    import deepspeed.comm as dist
    from deepspeed.utils import groups, mesh
    mesh.build_mesh(mesh.MeshDescription.standard(dist.get_world_size()))
    own = mesh._new_group((rank, ), dist.get_world_size())  # a one-rank group, cached like the mesh's own
    assert mesh._GROUP_CACHE.get((rank, )) is own and groups._MESH is not None
    dist.destroy_process_group()
    assert not dist.is_initialized()
    assert mesh._GROUP_CACHE == {} and mesh._CACHE_OWNER == [None]
    assert mesh._MESH is None and groups._MESH is None and groups.mpu is None


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_") and callable(fn)}


def _run_check(fn, rank):
    """None when ``fn`` passed on this rank, else what went wrong."""
    _MISMATCHES.clear()
    try:
        fn(rank)
    except Exception:
        _MISMATCHES.append(traceback.format_exc())
    return "\n".join(_MISMATCHES) or None


def _run_checks(rank, results):
    import deepspeed.comm as dist
    for name, fn in CHECKS.items():
        if name not in ("check_single_process_init", "check_destroy_forgets_mesh"):
            results[name] = _run_check(fn, rank)
            dist.barrier()  # keep the ranks in step from one check to the next


def _worker(rank, port, result_dir):
    os.environ["DS_ACCELERATOR"] = "cpu"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    import deepspeed.comm as dist
    results = {}
    dist.init_distributed(verbose=False)
    results["check_single_process_init"] = _run_check(check_single_process_init, rank)
    dist.destroy_process_group()

    os.environ.update(RANK=str(rank),
                      WORLD_SIZE=str(WORLD_SIZE),
                      LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_distributed(timeout=datetime.timedelta(seconds=60))  # a desynchronised check fails, not hangs
    try:
        _run_checks(rank, results)
        results["check_destroy_forgets_mesh"] = _run_check(check_destroy_forgets_mesh, rank)
    finally:
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        if dist.is_initialized():
            dist.destroy_process_group()
    # The results are on disk; skip the interpreter's teardown, which takes seconds after torch.distributed use.
    os._exit(0)


def _spawn(fn, args, nprocs, timeout_s):
    """Run ``fn(rank, *args)`` in ``nprocs`` fresh processes; kill them all past ``timeout_s``."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers did not finish within {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


@pytest.fixture(scope="module")
def worker_results():
    with tempfile.TemporaryDirectory() as result_dir:
        _spawn(_worker, (free_port(), result_dir), WORLD_SIZE, SPAWN_TIMEOUT_S)
        results = {}
        for rank in range(WORLD_SIZE):
            with open(os.path.join(result_dir, f"rank{rank}.json")) as f:
                results[rank] = json.load(f)
        return results


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_collective(worker_results, check):
    for rank in range(WORLD_SIZE):
        assert check in worker_results[rank], f"rank {rank} did not run {check}"
        failure = worker_results[rank][check]
        assert failure is None, f"rank {rank}:\n{failure}"


@pytest.mark.parametrize("message, collective, flag", [
    ("ProcessGroupGloo does not support reduce_scatter", "reduce_scatter", "reduce_scatter"),
    ("Backend gloo does not support _reduce_scatter_base", "reduce_scatter_tensor", "reduce_scatter_tensor"),
    ("Backend gloo does not support allgather_into_tensor_coalesced", "all_gather_into_tensor",
     "all_gather_into_tensor"),
    ("Cannot use ReduceOp.AVG with Gloo", "all_reduce", "avg"),
    ("Cannot use ReduceOp.AVG with Gloo", "reduce_scatter_tensor", "avg"),
])
def test_capability_learning(message, collective, flag):
    caps = fallbacks.GroupCapabilities()
    assert caps.learn(RuntimeError(message), collective)
    assert getattr(caps, flag) is False
    others = [name for name in fallbacks.GroupCapabilities.__slots__ if name != flag]
    assert all(getattr(caps, name) for name in others)


def test_real_errors_are_not_learned():
    caps = fallbacks.GroupCapabilities()
    assert not caps.learn(RuntimeError("Tensors must be contiguous"), "reduce_scatter_tensor")
    assert not caps.learn(RuntimeError("does not support"), "broadcast")  # no fallback exists for it
    assert all(getattr(caps, name) for name in fallbacks.GroupCapabilities.__slots__)


def test_discover_single_process(monkeypatch):
    from deepspeed.comm.env import discover
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    launch = discover()
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master_addr) == (0, 1, 0, "127.0.0.1")
    assert 0 < launch.master_port < 65536


def test_discover_mpi_and_errors(monkeypatch):
    from deepspeed.comm.env import discover
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        discover()
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    launch = discover(distributed_port=1234)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master_port) == (3, 4, 1, 1234)
    assert discover(auto_mpi_discovery=False).world_size == 1
    with pytest.raises(ValueError, match="outside world size"):
        discover(rank=4)
