# SPDX-License-Identifier: Apache-2.0
"""deepspeed.runtime.utils and the small deepspeed.utils modules, each against a plain reference."""

import logging
import random

import pytest
import torch

from deepspeed.runtime import utils as ds_utils
from tests.unit.common import run_distributed


def _sizes(bounds):
    return [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("seed", range(3))
def test_partition_uniform_against_reference(seed):
    rng = random.Random(seed)
    for _ in range(200):
        n, k = rng.randint(0, 40), rng.randint(1, 9)
        bounds = ds_utils.partition_uniform(n, k)
        assert len(bounds) == k + 1 and bounds[0] == 0 and bounds[-1] == min(n, bounds[-1])
        sizes = _sizes(bounds)
        if n <= k:  # one item per part, then empty parts
            assert sizes == [1] * n + [0] * (k - n)
        else:  # near-equal sizes, the larger ones first
            assert sum(sizes) == n and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_partition_balanced_examples():
    pb = ds_utils.partition_balanced
    assert pb([1, 1, 1, 1], 2) == [0, 2, 4]
    assert pb([1, 2, 3, 4, 5], 2) == [0, 3, 5]  # 6 | 9: spread 3 (1..4 | 5 would be 5)
    assert pb([3, 3, 3, 9], 2) == [0, 3, 4]
    assert pb([5, 1, 1, 1, 5], 3) == [0, 1, 4, 5]
    assert pb([1] * 7, 3) == [0, 3, 5, 7]  # ties: the latest cut
    assert pb([2, 2], 4) == ds_utils.partition_uniform(2, 4)


def _balanced_reference(w, k):
    """Upstream's definition of "balanced", written top-down: the split of the first ``i`` items into ``j`` parts
    extends the chosen split of a shorter prefix into ``j - 1`` parts by one last part, picking the prefix whose
    extension has the smallest spread (heaviest minus lightest part), the longest such prefix on a tie. (A greedy
    recurrence, not a global optimum over all splits; pipeline layer assignments depend on exactly these cuts.)"""
    import functools

    @functools.lru_cache(maxsize=None)
    def best(i, j):  # -> (spread, heaviest, lightest, bounds)
        if j == 0:
            return (0.0, 0.0, float("inf"), (0, )) if i == 0 else None
        chosen = None
        for cut in range(i):
            previous = best(cut, j - 1)
            if previous is None:
                continue
            part = sum(w[cut:i])
            heaviest = part if j == 1 else max(previous[1], part)
            lightest = min(previous[2], part)
            if chosen is None or heaviest - lightest <= chosen[0]:
                chosen = (heaviest - lightest, heaviest, lightest, previous[3] + (i, ))
        return chosen

    return list(best(len(w), k)[3])


def test_partition_balanced_against_reference():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(2, 9)
        k = rng.randint(1, min(n, 4))
        w = [rng.choice([rng.randint(0, 9), rng.random() * 5]) for _ in range(n)]
        got = ds_utils.partition_balanced(w, k)
        assert got[0] == 0 and got[-1] == n and all(s > 0 for s in _sizes(got)), got
        assert got == _balanced_reference(w, k), (w, k)


def test_prefix_sum_and_align():
    assert ds_utils.prefix_sum_inc([3, 4, 5]) == [3, 7, 12]
    tensors = [torch.ones(3), torch.ones(2)]
    padded = ds_utils.align_dense_tensors(tensors, 4)
    assert sum(t.numel() for t in padded) == 8 and torch.equal(padded[-1], torch.zeros(3))
    assert ds_utils.align_dense_tensors(tensors, 5) is tensors


@pytest.mark.parametrize("norm_type", [2, 1, 3.5, float("inf")])
def test_norms_against_torch(norm_type):
    torch.manual_seed(0)
    tensors = [torch.randn(5, 3), torch.randn(7), torch.randn(1)]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    expected = torch.linalg.vector_norm(flat, ord=norm_type)
    assert torch.allclose(ds_utils.get_global_norm_of_tensors(tensors, norm_type=norm_type), expected)
    params = [torch.nn.Parameter(t.clone()) for t in tensors]
    for p in params:
        p.grad = p.detach() * 2
    reference = [torch.nn.Parameter(t.clone()) for t in tensors]
    for p in reference:
        p.grad = p.detach() * 2
    assert ds_utils.get_flattened_grad_norm(params, norm_type) == pytest.approx(2 * float(expected), rel=1e-5)
    total = ds_utils.clip_grad_norm_(params, max_norm=0.5, norm_type=norm_type)
    ref_total = torch.nn.utils.clip_grad_norm_(reference, max_norm=0.5, norm_type=norm_type)
    assert torch.allclose(total, ref_total)
    for p, r in zip(params, reference):
        assert torch.allclose(p.grad, r.grad, atol=1e-6)
    assert ds_utils.get_weight_norm(params, norm_type) == pytest.approx(float(expected), rel=1e-5)


def test_clip_tensors_and_global_norm():
    a, b = torch.full((4, ), 3.0), torch.full((4, ), 4.0)
    norm = ds_utils.clip_tensors_by_global_norm([a, b], max_norm=1.0)
    assert float(norm) == pytest.approx(10.0)
    assert float(torch.linalg.vector_norm(torch.cat([a, b]))) == pytest.approx(1.0, rel=1e-5)
    assert ds_utils.get_global_norm([3.0, 4.0]) == pytest.approx(5.0)
    assert ds_utils.get_global_norm([3.0, -1]) == float("inf")
    assert float(ds_utils.combine_grad_norm_groups([torch.tensor(3.0), 4.0])) == pytest.approx(5.0)
    assert float(ds_utils.combine_grad_norm_groups([torch.tensor(-1.0), 4.0])) == float("inf")


def test_overflow_helpers():
    assert not bool(ds_utils.has_inf_or_nan(torch.ones(3)))
    assert bool(ds_utils.has_inf_or_nan(torch.tensor([1.0, float("nan")])))
    assert bool(ds_utils.has_inf_or_nan(torch.tensor([-float("inf"), 0.0])))
    assert not bool(ds_utils.has_inf_or_nan(torch.empty(0)))
    x = torch.tensor([1.0, float("inf"), float("nan")])
    ds_utils.mask_nan_or_inf_with_val_inplace(x)
    assert torch.equal(x, torch.tensor([1.0, -1.0, -1.0]))
    assert ds_utils.is_invalid_grad_norm(-1) and ds_utils.is_invalid_grad_norm(float("nan"))
    assert not ds_utils.is_invalid_grad_norm(torch.tensor(2.0))
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([0.0, float("inf")])
    assert ds_utils.CheckOverflow().has_overflow_serial([p])
    assert ds_utils.CheckOverflow([[p]]).check_using_norm([1.0, float("nan")], reduce_overflow=False)
    q = torch.nn.Parameter(torch.ones(3))
    q.grad = torch.tensor([0.0, 1.0, 0.0])
    assert ds_utils.get_grad_zeros([p, q]) == 3.0


def test_nested_moves_and_comparisons():
    item = {"a": [torch.ones(2), (torch.zeros(1), 3)], "b": "x"}
    copied = ds_utils.copy_to_device(item, "cpu", torch.is_tensor)
    assert copied["a"][1][1] == 3 and copied["b"] == "x" and torch.equal(copied["a"][0], item["a"][0])
    t = torch.ones(2)
    moved = ds_utils.move_to_device([t], "cpu", torch.is_tensor)
    assert moved[0] is t  # moved in place when the criterion holds
    assert ds_utils.get_tensor_bytes(item) == 2 * 4 + 1 * 4
    assert ds_utils.compare_tensors_in_structures([torch.ones(2), 1], [torch.ones(2), 1])
    assert not ds_utils.compare_tensors_in_structures([torch.ones(2)], [torch.zeros(2)])
    assert not ds_utils.compare_tensors_in_structures({"a": 1}, [1])
    assert ds_utils.call_to_str("f", 1, "a", k=2) == "f(1, 'a', k=2)"
    assert ds_utils.get_only_unique_item([3, 3]) == 3
    with pytest.raises(RuntimeError):
        ds_utils.get_only_unique_item([3, 4])
    groups = ds_utils.filter_empty_parameters([{"params": [torch.empty(0)], "lr": 1}, {"params": [torch.ones(1)]}])
    assert len(groups) == 1 and groups[0]["params"][0].numel() == 1


def test_tlinear_matches_its_source():
    torch.manual_seed(0)

    class Conv1D(torch.nn.Module):  # stores the weight as [in, out]

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(3, 5))
            self.bias = torch.nn.Parameter(torch.randn(5))

    source = Conv1D()
    layer = ds_utils.TLinear(source)
    x = torch.randn(2, 3)
    assert torch.allclose(layer(x), x @ source.weight + source.bias)


def test_count_used_parameters_in_backward():
    used, unused = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    params = list(used.parameters()) + list(unused.parameters())
    seen = []
    x = torch.randn(3, 2, requires_grad=True)
    out = used(x).sum()
    x.register_hook(lambda g: seen.append(ds_utils.count_used_parameters_in_backward(params)))
    out.backward()
    assert seen == [2]
    with pytest.raises(RuntimeError, match="during backward"):
        ds_utils.count_used_parameters_in_backward(params)


def test_output_backward_hooks_run_once_per_backward():
    calls = []
    x = torch.randn(2, requires_grad=True)
    outputs = (x * 2, {"b": x * 3})
    ds_utils.register_output_backward_hooks(outputs, lambda: calls.append("once"), lambda g: g * 10)
    (outputs[0].sum() + outputs[1]["b"].sum()).backward()
    assert calls == ["once"]
    assert torch.allclose(x.grad, torch.full((2, ), 50.0))  # (2 + 3) * 10


def partitioned_tensor_worker(shape):
    import deepspeed.comm as dist
    torch.manual_seed(0)  # the same tensor on every rank
    full = torch.randn(shape)
    part = ds_utils.PartitionedTensor(full, group=None)
    rebuilt = ds_utils.PartitionedTensor.from_meta(part.to_meta(), part.data(), group=None)
    assert part.full_size() == list(shape)
    return bool(torch.equal(rebuilt.full(), full)) and dist.get_world_size() == part.num_parts


@pytest.mark.parametrize("world,shape", [(2, (3, 5)), (3, (7, )), (3, (2, ))])
def test_partitioned_tensor_round_trip(world, shape):
    assert run_distributed(partitioned_tensor_worker, world, args=(shape, ), timeout=60) == [True] * world


def test_required_torch_version():
    from packaging import version

    from deepspeed.utils.torch import required_torch_version
    installed = version.parse(torch.__version__).release
    major_minor = f"{installed[0]}.{installed[1]}"
    assert required_torch_version(min_version=1.0)
    assert required_torch_version(min_version=major_minor, max_version=f"{installed[0] + 1}.0")
    assert not required_torch_version(min_version=f"{installed[0] + 1}.0")
    assert not required_torch_version(max_version="1.0")
    with pytest.raises(ValueError):
        required_torch_version()


def test_repeating_loader_restarts():
    from deepspeed.utils import RepeatingLoader
    loader = RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    assert iter(loader) is loader


def test_on_device_meta_and_dtype():
    from deepspeed import OnDevice
    before = torch.get_default_dtype()
    with OnDevice(dtype=torch.bfloat16, device="meta"):
        layer = torch.nn.Linear(4, 3)
        index = torch.zeros(2, dtype=torch.long)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.bfloat16
    assert index.dtype == torch.long and index.device.type == "meta"
    assert torch.get_default_dtype() == before and torch.zeros(1).device.type == "cpu"
    with OnDevice(dtype=torch.float16, device="meta", enabled=False):
        assert torch.nn.Linear(2, 2).weight.device.type == "cpu"


def test_numa_parsing_and_command(monkeypatch):
    from deepspeed.utils import numa
    assert list(numa.parse_range("5")) == [5] and list(numa.parse_range("2-4")) == [2, 3, 4]
    assert numa.parse_range_list("0,2-4,7") == [0, 2, 3, 4, 7]
    for bad in ("4-2", "1-2-3", "0-3,2"):
        with pytest.raises(ValueError):
            numa.parse_range_list(bad)
    monkeypatch.delenv("KMP_AFFINITY", raising=False)
    monkeypatch.setattr(numa, "check_for_numactl_pkg", lambda: True)
    monkeypatch.setattr(numa, "get_numa_cores", lambda: [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert numa.get_numactl_cmd("0-7", 2, 1) == (4, ["numactl", "-m", "1", "-C", "4-7"])
    assert numa.get_numactl_cmd("0-3,6,7", 3, 0) == (2, ["numactl", "-m", "0", "-C", "0-1"])
    assert numa.get_numactl_cmd("0-3,6,7", 3, 2) == (2, ["numactl", "-m", "1", "-C", "6-7"])
    monkeypatch.setattr(numa, "get_numa_cores", lambda: [[0, 1], [2, 3], [], []])  # flat HBM
    assert numa.get_numactl_cmd("0-3", 2, 1) == (2, ["numactl", "-p", "3", "-C", "2-3"])
    monkeypatch.setattr(numa, "get_numa_cores", lambda: [[0, 1, 2, 3], [0, 1, 2, 3]])  # fake NUMA
    assert numa.get_numactl_cmd("0-3", 1, 0) == (4, ["numactl", "-m", "0,1", "-C", "0-3"])
    monkeypatch.setenv("KMP_AFFINITY", "compact")
    with pytest.raises(ValueError, match="KMP_AFFINITY"):
        numa.get_numactl_cmd("0-3", 1, 0)


def test_nvtx_ranges_wrap_every_call(monkeypatch):
    from deepspeed.utils import nvtx
    events = []

    class Recorder:

        def range_push(self, msg):
            events.append(("push", msg))

        def range_pop(self):
            events.append(("pop", ))

    monkeypatch.setattr(nvtx, "get_accelerator", lambda: Recorder())

    @nvtx.instrument_w_nvtx
    def work(x):
        if x < 0:
            raise ValueError
        return x + 1

    assert work(1) == 2
    with pytest.raises(ValueError):
        work(-1)
    name = work.__wrapped__.__qualname__
    assert events == [("push", name), ("pop", ), ("push", name), ("pop", )]


def test_pinned_memory_tracker(caplog):
    from deepspeed.utils import pin_memory_tracker as tracker
    tracker._tracker.reset()
    tracker.track_pinned_memory(3 * 1024**2)
    tracker.track_pinned_memory(1024)
    logger = logging.getLogger("DeepSpeed")
    logger.propagate, saved = True, logger.propagate
    try:
        with caplog.at_level(logging.INFO, logger="DeepSpeed"):
            tracker.pinned_memory_summary("probe")
    finally:
        logger.propagate = saved
    assert "[pinned-memory probe] 3.00 MB pinned across 2 allocations" in caplog.text
    tracker._tracker.reset()


def test_log_level_from_string():
    from deepspeed.utils import logger, set_log_level_from_string
    saved = logger.level, [h.level for h in logger.handlers]
    try:
        set_log_level_from_string("ERROR")
        assert logger.level == logging.ERROR and all(h.level == logging.ERROR for h in logger.handlers)
        with pytest.raises(ValueError):
            set_log_level_from_string("loud")
    finally:
        logger.setLevel(saved[0])
        for handler, level in zip(logger.handlers, saved[1]):
            handler.setLevel(level)


def test_module_utils():
    from deepspeed.utils import recursive_getattr, recursive_setattr
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert recursive_getattr(model, "0.0") is model[0][0]
    new = torch.nn.Linear(2, 3)
    recursive_setattr(model, "0.0", new)
    assert model[0][0] is new
