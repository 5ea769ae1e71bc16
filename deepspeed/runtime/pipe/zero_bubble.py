# SPDX-License-Identifier: Apache-2.0
"""ZB-H1, a zero-bubble schedule: the backward split in two, the weight gradients filling the bubbles.

Each backward runs as an input-gradient pass ``I`` (the gradient the previous stage waits for, sent at once) and a
weight-gradient pass ``W`` (the parameters' gradients, which no other stage needs). A stage that is free starts,
in this order of preference: the next ``I`` whose gradient arrived (it unblocks the stage before), a forward while
it holds fewer than ``stages`` micro-batches whose weight gradient has not run (1F1B's peak, on its first stage:
no stage holds more activations than 1F1B's most loaded one), a pending ``W``.
The weight passes so move into the time 1F1B spends waiting, mostly in the cool-down: with forward, input- and
weight-gradient passes of equal cost the bubble is about a third of 1F1B's (Qi et al., "Zero Bubble Pipeline
Parallelism", arXiv 2401.10241; H1 is their variant at 1F1B's memory). The timetable and its lockstep transfers
are ``timetable.py``'s.

The engine runs ``I`` as ``torch.autograd.grad`` of the stage outputs with respect to its inputs (retaining the
graph, capturing the gradients that reach the layers holding parameters) and ``W`` from those captured gradients;
the weight gradients then reach the stage's gradient pipeline through the backward session, with the same factor
as every other backward. Gradients are the same as 1F1B's.
"""

from deepspeed.runtime.pipe.timetable import TimetableSchedule


class _Greedy:
    """The free stage's preference: input gradient, forward within 1F1B's peak memory, weight gradient."""

    ops_per_micro_batch = 3

    def __init__(self, micro_batches, stages):
        self.m, self.p = micro_batches, stages
        self.next_f = [0] * stages
        self.next_i = [0] * stages
        self.pending_w = [[] for _ in range(stages)]

    def pick(self, stage, state):
        i = self.next_i[stage]
        if i < self.m and state.ready(stage, ("I", i, 0)):
            self.next_i[stage] += 1
            self.pending_w[stage].append(i)
            return ("I", i, 0)
        f = self.next_f[stage]
        held = f - (self.next_i[stage] - len(self.pending_w[stage]))  # forwarded, weight gradient not started
        if f < self.m and held < self.p and state.ready(stage, ("F", f, 0)):
            self.next_f[stage] += 1
            return ("F", f, 0)
        if self.pending_w[stage]:
            return ("W", self.pending_w[stage].pop(0), 0)
        return None


class ZeroBubbleH1Schedule(TimetableSchedule):
    """ZB-H1 (module docstring)."""

    @classmethod
    def planner(cls, micro_batches, stages, chunks):
        return _Greedy(micro_batches, stages)

    @staticmethod
    def check_support(module, config, chunks):
        from deepspeed.runtime.pipe import split_backward
        split_backward.check_available()
        if config.zero_optimization_stage == 3:
            raise NotImplementedError("pipeline.schedule 'zero_bubble' with ZeRO stage 3 is not supported: a weight "
                                      "pass runs after its layers' parameters were released; use ZeRO 0-2, or '1f1b' "
                                      "/ 'interleaved_1f1b' with ZeRO-3")
        if module.activation_checkpoint_interval > 0 or config.pipeline["activation_checkpoint_interval"] > 0:
            raise NotImplementedError(
                "pipeline.schedule 'zero_bubble' with activation checkpointing is not supported: "
                "the split backward keeps the graph between its two halves; use '1f1b' or "
                "'interleaved_1f1b' with checkpointing")
