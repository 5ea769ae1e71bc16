# SPDX-License-Identifier: Apache-2.0
"""``benchmarks/time_to_loss.py``: the first step at or below a loss and the step time spent until then, against a
direct loop over random rows; the table and the plot from JSON lines."""

import json
import random
import statistics

from benchmarks.time_to_loss import main, time_to_loss

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def random_row(rng, n):
    losses, loss = [], 10.0
    for _ in range(n):
        loss -= rng.uniform(-0.05, 0.2)
        losses.append(loss)
    times = [rng.uniform(0.1, 1.0) for _ in range(n)]
    warm = rng.randint(0, 3)
    return dict(system="s", status="ok", losses=losses, warmup_times_s=times[:warm], step_times_s=times[warm:])


def direct(row, threshold):
    times = list(row["warmup_times_s"]) + list(row["step_times_s"])
    median = statistics.median(times)
    spent = capped = 0.0
    for step, (loss, t) in enumerate(zip(row["losses"], times), start=1):
        spent += t
        capped += min(t, median)
        if loss <= threshold:
            return step, spent, capped
    return None


def test_time_to_loss_against_a_direct_loop():
    rng = random.Random(5)
    for _ in range(50):
        row = random_row(rng, rng.randint(1, 40))
        thresholds = [rng.uniform(5.0, 10.5) for _ in range(3)]
        for got, threshold in zip(time_to_loss(row, thresholds), thresholds):
            want = direct(row, threshold)
            if want is None:
                assert got is None
            else:
                assert got[0] == want[0] and abs(got[1] - want[1]) < 1e-9 and abs(got[2] - want[2]) < 1e-9


def test_table_and_plot(tmp_path):
    rng = random.Random(7)
    a, b = random_row(rng, 20), random_row(rng, 20)
    b["system"] = "t"
    (tmp_path / "a.jsonl").write_text(json.dumps(a) + "\n" + json.dumps(b) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(dict(a, label="s variant")) + "\n")
    out, png = tmp_path / "ttl.md", tmp_path / "ttl.png"
    reached = repr(a["losses"][9])  # reached by "s" at step 10 at the latest
    assert main([
        str(tmp_path / "a.jsonl"),
        str(tmp_path / "b.jsonl"), "--thresholds", reached, "-1", "--out",
        str(out), "--plot",
        str(png)
    ]) == 0
    lines = out.read_text().splitlines()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:]}
    assert set(rows) == {"s", "t", "s variant"}
    step, spent, capped = direct(a, float(reached))
    assert f"| {step} / {spent:.2f} / {capped:.2f} | not reached |" in rows["s"]  # and -1 is never reached
    assert rows["t"].count("not reached") == (1 if direct(b, float(reached)) else 2)
    assert png.read_bytes()[:8] == PNG_SIGNATURE
