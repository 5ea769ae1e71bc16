# SPDX-License-Identifier: Apache-2.0
"""``bench_audit.py`` on a tiny CPU model: it times an audit and reports the true and the doubled gradient's errors."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_tiny_cpu_run(tmp_path):
    out = tmp_path / "audit.md"
    command = [
        sys.executable,
        os.path.join(REPO, "benchmarks",
                     "bench_audit.py"), "--device", "cpu", "--d-model", "32", "--layers", "1", "--heads", "2",
        "--vocab", "64", "--seq", "16", "--micro-batch", "2", "--gas", "2", "--warmup", "1", "--repeats", "1", "--out",
        str(out)
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    done = subprocess.run(command, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row, ) = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert row["window_evaluations"] == 2 * row["directions"] == 8
    assert row["true_ok"] and row["true_max_rel_error"] <= row["tolerance"]
    assert not row["doubled_ok"] and row["doubled_max_rel_error"] > row["tolerance"]
    assert row["audit_s"] > 0 and row["window_forward_s"] > 0
    assert "| 2 |" in out.read_text()
