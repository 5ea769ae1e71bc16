# SPDX-License-Identifier: Apache-2.0
"""Loss and step time per system, from the rows of ``train_bench.py``; matplotlib is imported only here.

``python benchmarks/plots.py bench.jsonl bench.png`` redraws the figure of an earlier run from its JSON lines;
``train_bench.py --plot bench.png`` draws it at the end of a run.
"""

import json
import sys


def plot_rows(rows, path, title=None):
    """Write a PNG with two panels, loss per optimizer step and step time per optimizer step, one line per system
    that ran (``status == "ok"``; others are listed in the legend as not run). Warm-up steps are marked by a shaded
    band. Returns the systems drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (loss_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4))
    drawn, warmup = [], 0
    for row in rows:
        if row.get("status") != "ok":
            loss_ax.plot([], [], label=f"{row['system']} ({row.get('status', 'not run')})")
            continue
        losses = row["losses"]
        times = list(row.get("warmup_times_s", [])) + list(row["step_times_s"])
        warmup = max(warmup, len(row.get("warmup_times_s", [])))
        steps = list(range(1, len(losses) + 1))
        loss_ax.plot(steps, losses, marker=".", label=row["system"])
        time_ax.plot(list(range(1, len(times) + 1)), times, marker=".", label=row["system"])
        drawn.append(row["system"])
    for ax in (loss_ax, time_ax):
        if warmup:
            ax.axvspan(0.5, warmup + 0.5, color="0.9", zorder=0)
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    loss_ax.set_ylabel("loss (mean over ranks)")
    loss_ax.set_title("training loss")
    time_ax.set_ylabel("step time (s, slowest rank)")
    time_ax.set_title("step time" + (" (shaded: warm-up)" if warmup else ""))
    loss_ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def read_rows(jsonl_path):
    with open(jsonl_path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/plots.py RUN.jsonl OUT.png")
    plot_rows(read_rows(sys.argv[1]), sys.argv[2], title=sys.argv[1])
