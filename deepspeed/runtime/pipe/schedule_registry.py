# SPDX-License-Identifier: Apache-2.0
"""Which schedule class a ``pipeline.schedule`` config value selects, and what each needs of the model."""

from deepspeed.runtime.pipe import schedule


def schedule_class(name):
    if name == "1f1b":
        return schedule.TrainSchedule
    if name == "interleaved_1f1b":
        from deepspeed.runtime.pipe.interleaved import Interleaved1F1BSchedule
        return Interleaved1F1BSchedule
    if name == "zero_bubble":
        from deepspeed.runtime.pipe.zero_bubble import ZeroBubbleH1Schedule
        return ZeroBubbleH1Schedule
    raise ValueError(f"unknown pipeline schedule {name!r}")


def build_schedule(name, micro_batches, stages, stage_id, chunks=1):
    """The training schedule ``name`` for one stage."""
    cls = schedule_class(name)
    if name == "interleaved_1f1b":
        return cls(micro_batches=micro_batches, stages=stages, stage_id=stage_id, chunks=chunks)
    return cls(micro_batches=micro_batches, stages=stages, stage_id=stage_id)


def check_schedule_support(name, module, config, chunks):
    """Raise (the same on every rank) for a schedule the model or config cannot run."""
    cls = schedule_class(name)
    check = getattr(cls, "check_support", None)
    if check is not None:
        check(module, config, chunks)
