# SPDX-License-Identifier: Apache-2.0
"""Time to a loss, per system, from the JSON lines of ``train_bench.py`` runs (same data and initialisation).

``python benchmarks/time_to_loss.py --thresholds 9.0 8.8 --out ttl.md --plot ttl.png A.jsonl B.jsonl ...`` prints
and writes, per system that ran: the first optimizer step whose loss is at or below each threshold, the seconds the
steps up to it took (every step counted, warm-up steps too, since their progress counts: the cumulative step time),
the same with each step's time capped at the system's median step time (one-off costs such as a first step's JIT
build or first-touch allocation left out), the median step time, the mean of the timed steps (every one counted,
host steps included) and the loss after the last step. ``--plot`` draws
the loss against cumulative step time (needs matplotlib). A system named twice (two runs) keeps both rows, labelled
by file.
"""

import argparse
import json
import os
import statistics
import sys


def step_times(row):
    return list(row.get("warmup_times_s") or []) + list(row["step_times_s"])


def time_to_loss(row, thresholds):
    """Per threshold: (step, cumulative seconds, capped seconds) of the first step at or below it, or None."""
    losses, times = row["losses"], step_times(row)
    median = statistics.median(times)
    out = []
    for threshold in thresholds:
        hit = next((i for i, loss in enumerate(losses) if loss <= threshold), None)
        if hit is None:
            out.append(None)
            continue
        out.append((hit + 1, sum(times[:hit + 1]), sum(min(t, median) for t in times[:hit + 1])))
    return out


def load(paths):
    rows = []
    for path in paths:
        with open(path) as handle:
            for line in handle:
                if line.strip():
                    row = json.loads(line)
                    row["label"] = row.get("label") or row["system"]
                    row["file"] = os.path.basename(path)
                    rows.append(row)
    labels = [r["label"] for r in rows]
    for row in rows:
        if labels.count(row["label"]) > 1:
            row["label"] = f"{row['label']} ({row['file']})"
    return rows


def render(rows, thresholds):
    head = " | ".join(f"to {t:g}: step / s / s capped" for t in thresholds)
    lines = [
        f"| system | {head} | median step (s) | mean timed step (s) | steps | final loss |",
        "| --- | " + " | ".join("---:" for _ in thresholds) + " | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        if row.get("status") != "ok":
            lines.append(f"| {row['label']} | {row.get('status')}: {row.get('error', '')} |")
            continue
        cells = []
        for hit in time_to_loss(row, thresholds):
            cells.append("not reached" if hit is None else f"{hit[0]} / {hit[1]:.2f} / {hit[2]:.2f}")
        times = step_times(row)
        timed = list(row["step_times_s"])
        lines.append(f"| {row['label']} | {' | '.join(cells)} | {statistics.median(times):.3f} | "
                     f"{statistics.mean(timed):.3f} | {len(times)} | {row['losses'][-1]:.4f} |")
    return "\n".join(lines) + "\n"


def plot(rows, thresholds, path, title=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (time_ax, step_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for row in rows:
        if row.get("status") != "ok":
            continue
        times, elapsed = step_times(row), []
        for t in times:
            elapsed.append((elapsed[-1] if elapsed else 0.0) + t)
        time_ax.plot(elapsed, row["losses"], marker=".", label=row["label"])
        step_ax.plot(range(1, len(row["losses"]) + 1), row["losses"], marker=".", label=row["label"])
    for ax in (time_ax, step_ax):
        for t in thresholds:
            ax.axhline(t, color="0.6", linestyle="--", linewidth=0.8)
        ax.grid(True, alpha=0.3)
        ax.set_ylabel("loss (mean over ranks)")
    time_ax.set_xlabel("cumulative step time (s)")
    time_ax.set_title("loss against time")
    step_ax.set_xlabel("optimizer step")
    step_ax.set_title("loss against steps")
    time_ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("jsonl", nargs="+")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[9.0, 8.8])
    parser.add_argument("--out", default=None, help="markdown table")
    parser.add_argument("--plot", default=None, help="PNG: loss against cumulative step time and against steps")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    rows = load(args.jsonl)
    table = render(rows, args.thresholds)
    print(table)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write((f"# {args.title}\n\n" if args.title else "") + table)
    if args.plot:
        plot(rows, args.thresholds, args.plot, args.title)
        print(f"[time_to_loss] plot written to {args.plot}")
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
