# SPDX-License-Identifier: Apache-2.0
"""The long-sequence benchmark's memory projection: a straight line through the two longest successful steps."""

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "sp_bench.py")


@pytest.fixture(scope="module")
def sp_bench():
    spec = importlib.util.spec_from_file_location("sp_bench_under_test", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_projection_is_the_line_through_the_two_longest_successes(sp_bench):
    trials = [
        {
            "seq": 1000,
            "ok": True,
            "peak_gib": 30.0
        },
        {
            "seq": 2000,
            "ok": True,
            "peak_gib": 31.0
        },
        {
            "seq": 4000,
            "ok": True,
            "peak_gib": 35.0
        },  # 2 GiB per 1000 tokens from here
        {
            "seq": 8000,
            "ok": False,
            "peak_gib": 90.0
        },  # failures do not count
    ]
    got = sp_bench.project(trials, 45.0)
    # 35 + 2/1000 * (s - 4000) = 45  ->  s = 9000
    assert got["seq"] == 9000
    assert got["gib_per_1k_tokens"] == pytest.approx(2.0 * 1024 / 1000)


def test_projection_needs_two_lengths_and_growth(sp_bench):
    assert sp_bench.project([{"seq": 1000, "ok": True, "peak_gib": 3.0}], 10.0) is None
    flat = [{"seq": 1000, "ok": True, "peak_gib": 3.0}, {"seq": 2000, "ok": True, "peak_gib": 3.0}]
    assert sp_bench.project(flat, 10.0) is None
    # a repeated length keeps its largest peak
    rep = [{
        "seq": 1000,
        "ok": True,
        "peak_gib": 2.0
    }, {
        "seq": 1000,
        "ok": True,
        "peak_gib": 4.0
    }, {
        "seq": 2000,
        "ok": True,
        "peak_gib": 5.0
    }]
    assert sp_bench.project(rep, 6.0)["seq"] == 3000


def test_trace_summary_reports_what_is_live_at_the_peak(sp_bench):

    def frame(name):
        return [{
            "filename": "/x/site-packages/torch/nn/functional.py",
            "line": 1,
            "name": "f"
        }, {
            "filename": f"/x/{name}.py",
            "line": 7,
            "name": name
        }]

    events = [
        {
            "action": "alloc",
            "addr": 1,
            "size": 2**30,
            "frames": frame("a")
        },
        {
            "action": "alloc",
            "addr": 2,
            "size": 2**31,
            "frames": frame("b")
        },
        {
            "action": "free_completed",
            "addr": 1
        },
        {
            "action": "alloc",
            "addr": 3,
            "size": 2**31,
            "frames": frame("b")
        },  # the peak: b's 2 + 2 GiB
        {
            "action": "free_completed",
            "addr": 2
        },
        {
            "action": "alloc",
            "addr": 4,
            "size": 2**30,
            "frames": frame("a")
        },
    ]
    got = sp_bench._trace_summary({"device_traces": [events]})
    assert got["peak_recorded_gib"] == 4.0
    assert got["live_at_peak"] == [{"where": "/x/b.py:7 b", "gib": 4.0, "count": 2}]


def test_lengths_step_exactly_those_and_report_the_longest_success(sp_bench, monkeypatch):
    import argparse
    stepped = []

    def fake_trial(state, args, impl, seq):
        stepped.append(seq)
        ok = seq <= 1500  # a step fails above 1500 tokens
        return {"seq": seq, "ok": ok, "seconds": 0.0, "peak_gib": seq / 100 if ok else None}

    monkeypatch.setattr(sp_bench, "_trial", fake_trial)
    args = argparse.Namespace(lengths="1000,2000,1500", start=16, cap=1 << 20, resolution=8, time_budget=60.0,
                              compare_at=0, no_throughput=True, cpu=True, tiny=True, layers=1)
    result = sp_bench.search(args, "ours")
    assert stepped == [1000, 2000, 1500]  # no doubling, no bisecting
    assert (result["longest_ok"], result["first_oom"], result["capped"]) == (1500, 2000, True)
