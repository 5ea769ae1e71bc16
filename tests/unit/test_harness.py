# SPDX-License-Identifier: Apache-2.0
"""Tests of the multi-rank harness itself: results, collectives, failure reports, timeouts and pool reuse."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.unit.common import DistributedTestError, distributed_test, run_distributed
from tests.unit.harness import get_pool

# ---- worker functions (module level: they are pickled by reference) ----


def _identity(tag):
    return dict(
        tag=tag,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        backend=dist.get_backend(),
        env={key: os.environ.get(key)
             for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")},
        threads=torch.get_num_threads(),
        pid=os.getpid())


def _all_reduce_rank_plus_one():
    tensor = torch.full((4, ), float(dist.get_rank() + 1))
    dist.all_reduce(tensor)
    return tensor


def _draw_random_and_leak_state():
    drawn = torch.rand(5)
    os.environ["HARNESS_TEST_LEAK"] = "1"
    torch.set_num_threads(2)
    return drawn


def _leaked_state():
    return os.environ.get("HARNESS_TEST_LEAK"), torch.get_num_threads()


def _raise_on_rank(bad_rank):
    print(f"output of rank {dist.get_rank()}")
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom on rank {bad_rank}")
    return "fine"


def _raise_everywhere():
    raise KeyError(f"missing on rank {dist.get_rank()}")


def _raise_on_rank_1_while_rank_0_waits():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up before the collective")
    dist.all_reduce(torch.ones(1))


def _rank_0_waits_in_collective_forever():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def _pid():
    return os.getpid()


def _nested_call_error():
    try:
        run_distributed(_pid, 1)
    except RuntimeError as exc:
        return str(exc)
    return None


@distributed_test(world_size=2)
def _decorated_rank_square(offset):
    return (dist.get_rank() + offset)**2


# ---- tests ----


def _assert_dead(pid):
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_results_come_back_per_rank(world_size):
    results = run_distributed(_identity, world_size, args=("hello", ))
    assert len(results) == world_size
    port = results[0]["env"]["MASTER_PORT"]
    for rank, result in enumerate(results):
        assert result["tag"] == "hello"
        assert (result["rank"], result["world_size"], result["backend"]) == (rank, world_size, "gloo")
        assert result["env"] == dict(RANK=str(rank),
                                     WORLD_SIZE=str(world_size),
                                     LOCAL_RANK=str(rank),
                                     MASTER_ADDR="127.0.0.1",
                                     MASTER_PORT=port)
        assert result["threads"] == 1
    assert len({result["pid"] for result in results} | {os.getpid()}) == world_size + 1


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_all_reduce_sums_over_ranks(world_size):
    results = run_distributed(_all_reduce_rank_plus_one, world_size)
    expected = torch.full((4, ), float(sum(range(1, world_size + 1))))
    for result in results:
        assert torch.equal(result, expected)


def test_each_call_is_seeded_and_reset():
    first = run_distributed(_draw_random_and_leak_state, 2)
    for rank, drawn in enumerate(first):
        reference = torch.rand(5, generator=torch.Generator().manual_seed(1234 + rank))
        assert torch.equal(drawn, reference)
    assert not torch.equal(first[0], first[1])
    assert run_distributed(_leaked_state, 2) == [(None, 1), (None, 1)]
    assert all(torch.equal(a, b) for a, b in zip(first, run_distributed(_draw_random_and_leak_state, 2)))


def test_reuse_hits_the_same_workers():
    first = run_distributed(_pid, 2)
    second = run_distributed(_pid, 2)
    assert first == second
    assert first == get_pool(2).pids


def test_raising_rank_reports_every_rank():
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_raise_on_rank, 3, args=(1, ))
    message = str(caught.value)
    assert "rank 0: ok" in message and "rank 2: ok" in message
    assert "rank 1: raised (ValueError: boom on rank 1)" in message
    assert "Traceback" in message and "_raise_on_rank" in message
    for rank in range(3):
        assert f"output of rank {rank}" in message
    assert [outcome.ok for outcome in caught.value.outcomes] == [True, False, True]


def test_failure_with_consistent_ranks_keeps_the_pool():
    before = run_distributed(_pid, 2)
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_raise_everywhere, 2)
    assert "rank 0: raised (KeyError: 'missing on rank 0')" in str(caught.value)
    assert "rank 1: raised (KeyError: 'missing on rank 1')" in str(caught.value)
    assert "restarts on next use" not in str(caught.value)
    assert run_distributed(_pid, 2) == before


def test_raise_while_peer_waits_does_not_wait_for_the_timeout():
    old_pids = run_distributed(_pid, 2)
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_raise_on_rank_1_while_rank_0_waits, 2, timeout=60.0)
    assert time.monotonic() - start < 8.0
    outcomes = caught.value.outcomes
    assert [outcome.ok for outcome in outcomes] == [False, False]
    assert "rank 1 gives up before the collective" in str(caught.value)
    assert "restarts on next use" in str(caught.value)
    for pid in old_pids:
        _assert_dead(pid)
    assert run_distributed(_all_reduce_rank_plus_one, 2)[0].tolist() == [3.0] * 4


def test_deadlock_is_cut_by_the_timeout_and_the_pool_restarts():
    old_pids = run_distributed(_pid, 2)
    starts = get_pool(2).starts
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_rank_0_waits_in_collective_forever, 2, timeout=3.0)
    elapsed = time.monotonic() - start
    assert 3.0 <= elapsed < 13.0
    message = str(caught.value)
    assert "rank(s) [0] did not answer" in message and "rank 1: ok" in message
    assert "_rank_0_waits_in_collective_forever" in message  # the stack dump of the hung rank
    for pid in old_pids:
        _assert_dead(pid)
    new_pids = run_distributed(_pid, 2)
    assert set(new_pids).isdisjoint(old_pids)
    assert get_pool(2).starts == starts + 1
    assert run_distributed(_all_reduce_rank_plus_one, 2)[1].tolist() == [3.0] * 4


def test_decorated_worker_returns_per_rank_results():
    assert _decorated_rank_square(3) == [9, 16]


@pytest.mark.parametrize("scale", [1.0, 2.5])
@distributed_test(world_size=3)
def test_decorated_test_runs_on_every_rank(scale):
    tensor = torch.tensor([scale * (dist.get_rank() + 1)])
    dist.all_reduce(tensor)
    assert tensor.item() == pytest.approx(scale * 6.0)


def test_unpicklable_function_is_refused_in_the_caller():
    with pytest.raises(Exception, match="pickle|attribute lookup"):
        run_distributed(lambda: None, 2)


def test_nested_call_from_a_worker_is_refused():
    assert run_distributed(_nested_call_error, 1) == ["run_distributed cannot be called from inside a pool worker"]
