# SPDX-License-Identifier: Apache-2.0
"""``train_bench.py --plot``: a tiny CPU run records every step's loss and time per system and draws them."""

import json
import os
import subprocess
import sys

from benchmarks.plots import plot_rows

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_plot_rows(tmp_path):
    rows = [
        dict(system="a", status="ok", losses=[3.0, 2.5, 2.0], warmup_times_s=[0.5], step_times_s=[0.2, 0.21]),
        dict(system="b", status="ok", losses=[3.0, 2.6, 2.1], warmup_times_s=[0.4], step_times_s=[0.3, 0.31]),
        dict(system="c", status="error", error="out of memory"),
    ]
    path = tmp_path / "plot.png"
    assert plot_rows(rows, str(path), title="t") == ["a", "b"]
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_tiny_cpu_run_with_plot(tmp_path):
    png, out = tmp_path / "bench.png", tmp_path / "bench.md"
    command = [
        sys.executable,
        os.path.join(REPO, "benchmarks", "train_bench.py"), "--device", "cpu", "--d-model", "16", "--layers", "1",
        "--heads", "2", "--vocab", "32", "--seq", "8", "--micro-batch", "2", "--gas", "1", "--warmup", "1", "--steps",
        "2", "--systems", "ds_zero2", "--out",
        str(out), "--plot",
        str(png)
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    done = subprocess.run(command, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    (row, ) = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert row["status"] == "ok" and len(row["losses"]) == 3
    assert len(row["warmup_times_s"]) == 1 and len(row["step_times_s"]) == 2
    assert "plot written to" in done.stdout


def test_plot_option():
    from benchmarks.train_bench import parse_args
    assert parse_args(["--plot", "x.png"]).plot == "x.png" and parse_args([]).plot is None
