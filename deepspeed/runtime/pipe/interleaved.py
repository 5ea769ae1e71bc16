# SPDX-License-Identifier: Apache-2.0
"""Interleaved 1F1B: each stage holds ``chunks`` model chunks, round robin, and the warm-up and cool-down shrink.

With ``p`` stages and ``v`` chunks the model is cut into ``p * v`` parts; stage ``s`` holds parts ``s, s + p,
...`` (``PipelineModule`` is cut so when ``pipeline.schedule`` is ``interleaved_1f1b``). Micro-batches go through
the chunks in groups of ``p``: a stage runs the forwards of a group on chunk 0, then on chunk 1, ..., and the
backwards in reverse chunk order; it warms up with ``2 (p - s - 1) + (v - 1) p`` forwards, then alternates one
forward and one backward, then drains the backwards (the order of Narayanan et al., arXiv 2104.04473, as
Megatron-LM runs it). Each stage follows that order through a timetable (``timetable.py``), waiting where an
input has not arrived. The bubble is about ``(p - 1) / (v m)`` of the ideal time instead of ``(p - 1) / m``, for
``v`` times more transfers; activations travel from the last stage back to the first between chunks.
"""

from deepspeed.runtime.pipe.timetable import TimetableSchedule


def stage_order(micro_batches, stages, stage, chunks):
    """Stage ``stage``'s computations in order, ``(kind, micro_batch, chunk)`` (module docstring)."""
    forwards, backwards = [], []
    for start in range(0, micro_batches, stages):
        group = range(start, min(start + stages, micro_batches))
        for chunk in range(chunks):
            forwards += [(mb, chunk) for mb in group]
        for chunk in reversed(range(chunks)):
            backwards += [(mb, chunk) for mb in group]
    total = len(forwards)
    if chunks == 1:
        warm = min(stages - stage - 1, total)
    else:
        warm = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)
    out = [("F", mb, c) for mb, c in forwards[:warm]]
    for i, (mb, c) in enumerate(forwards[warm:]):
        out += [("F", mb, c), ("B", ) + backwards[i]]
    return out + [("B", mb, c) for mb, c in backwards[total - warm:]]


class _InOrder:
    """Each stage runs its order; a computation waits until its inputs arrived."""

    ops_per_micro_batch = 2

    def __init__(self, micro_batches, stages, chunks):
        self.orders = [stage_order(micro_batches, stages, s, chunks) for s in range(stages)]
        self.next = [0] * stages

    def pick(self, stage, state):
        order = self.orders[stage]
        if self.next[stage] < len(order) and state.ready(stage, order[self.next[stage]]):
            self.next[stage] += 1
            return order[self.next[stage] - 1]
        return None


class Interleaved1F1BSchedule(TimetableSchedule):
    """Interleaved 1F1B over ``chunks`` model chunks per stage (module docstring)."""

    def __init__(self, micro_batches, stages, stage_id, chunks=2):
        super().__init__(micro_batches, stages, stage_id)
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        if chunks > 1 and stages < 2:
            raise ValueError("an interleaved schedule needs at least 2 pipeline stages")
        if chunks > 1 and micro_batches % stages != 0:
            raise ValueError(f"an interleaved schedule runs micro-batches in groups of the number of stages: "
                             f"{micro_batches} micro-batches (gradient_accumulation_steps) must be a multiple of "
                             f"{stages} stages")
        self.chunks = int(chunks)

    @classmethod
    def planner(cls, micro_batches, stages, chunks):
        return _InOrder(micro_batches, stages, chunks)

    @staticmethod
    def check_support(module, config, chunks):
        if chunks < 2:
            raise ValueError(f"pipeline.schedule 'interleaved_1f1b' needs pipeline.virtual_stages >= 2, got {chunks}")
        if module.num_stages < 2:
            raise ValueError("pipeline.schedule 'interleaved_1f1b' needs at least 2 pipeline stages")
        if config.gradient_accumulation_steps % module.num_stages != 0:
            raise ValueError(f"pipeline.schedule 'interleaved_1f1b' runs micro-batches in groups of the number of "
                             f"stages: gradient_accumulation_steps ({config.gradient_accumulation_steps}) must be a "
                             f"multiple of {module.num_stages}")
