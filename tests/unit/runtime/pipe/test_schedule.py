# SPDX-License-Identifier: Apache-2.0
"""Schedules as data: upstream's instruction lists step for step, and every schedule checked on paper (no deadlock,
transfers that pair up, each micro-batch's forward before its backward, the step last) with its bubble measured."""

import json
import os

import pytest

from deepspeed.runtime.pipe import schedule as S
from deepspeed.runtime.pipe.schedule_check import ScheduleError, check_schedule
from deepspeed.runtime.pipe.schedule_registry import build_schedule

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "upstream_schedules.json")


def test_upstream_schedules_step_for_step():
    with open(FIXTURE) as handle:
        fixture = json.load(handle)
    assert fixture["deepspeed"] == "0.19.8"
    for key, expected in fixture["schedules"].items():
        name, stages, micro_batches, stage = key.split("-")
        sched = getattr(S, name)(int(micro_batches), int(stages), int(stage))
        got = [[repr(cmd) for cmd in cmds] for cmds in sched] + [sched.num_pipe_buffers()]
        assert got == expected, key


def _train(name, chunks=1):
    return lambda m, p, s: build_schedule(name, m, p, s, chunks)


SCHEDULES = {
    "1f1b": _train("1f1b"),
    "interleaved-2": _train("interleaved_1f1b", 2),
    "interleaved-3": _train("interleaved_1f1b", 3),
    "zero_bubble": _train("zero_bubble"),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_checks_out(name):
    """Any stages and micro-batches (including fewer micro-batches than stages)."""
    for stages in range(1, 6):
        for micro_batches in range(1, 10):
            if name.startswith("interleaved") and (stages < 2 or micro_batches % stages):
                with pytest.raises(ValueError):  # groups of `stages` micro-batches go through the chunks
                    SCHEDULES[name](micro_batches, stages, 0)
                continue
            report = check_schedule(SCHEDULES[name], stages, micro_batches)
            assert len(report.finish) == stages
    for stages in range(1, 5):
        for micro_batches in (1, 2, 5):
            check_schedule(lambda m, p, s: S.InferenceSchedule(m, p, s), stages, micro_batches, training=False)


def test_bubbles():
    """With forward 1, backward 2 (input and weight halves 1 each): 1F1B takes 3 (m + p - 1); interleaving v chunks
    cuts the warm-up and cool-down by v; the zero-bubble schedule fills the cool-down with weight gradients."""
    for stages, micro_batches in [(2, 8), (4, 8), (4, 16)]:
        base = check_schedule(SCHEDULES["1f1b"], stages, micro_batches)
        assert base.makespan == 3 * (micro_batches + stages - 1)
        zb = check_schedule(SCHEDULES["zero_bubble"], stages, micro_batches)
        assert zb.makespan < base.makespan and zb.bubble < base.bubble
        assert max(zb.peak_live) <= max(base.peak_live)  # no more activations held than 1F1B
        inter = check_schedule(SCHEDULES["interleaved-2"],
                               stages,
                               micro_batches,
                               costs=dict(forward=0.5, backward=1.0))  # chunks are half as deep
        assert inter.bubble < base.bubble


class _Broken(S.TrainSchedule):
    """1F1B with one edit per ``kind``: what the checker must refuse."""

    def __init__(self, micro_batches, stages, stage_id, kind):
        super().__init__(micro_batches, stages, stage_id)
        self.kind = kind

    def steps(self):
        steps = [list(cmds) for cmds in super().steps()]
        if self.kind == "deadlock" and self.stage_id == 0:  # a gradient before any activation left: both wait
            steps = [[S.RecvGrad(0)]] + steps
        if self.kind == "backward-first" and self.stage_id == self.stages - 1:
            for cmds in steps:
                fwd = [i for i, c in enumerate(cmds) if isinstance(c, S.ForwardPass)]
                if fwd:
                    cmds.insert(fwd[0], S.BackwardPass(cmds[fwd[0]].buffer_id))
                    break
        if self.kind == "no-step":
            steps[-1] = [c for c in steps[-1] if not isinstance(c, S.OptimizerStep)]
        yield from steps


@pytest.mark.parametrize("kind,match", [("deadlock", "deadlock|pairs with"), ("backward-first", "backward"),
                                        ("no-step", "optimizer step")])
def test_the_checker_refuses_broken_schedules(kind, match):
    with pytest.raises(ScheduleError, match=match):
        check_schedule(lambda m, p, s: _Broken(m, p, s, kind), 2, 3)
