# SPDX-License-Identifier: Apache-2.0
"""Schedules built as a timetable: when each stage computes what, and the transfers in lockstep.

A subclass of :class:`TimetableSchedule` gives a *planner* that picks, whenever a stage is free, which computation
it starts (``pick``): ``("F", micro_batch, chunk)`` a forward, ``("B", ...)`` a whole backward, ``("I", ...)`` the
input-gradient half of a backward and ``("W", ...)`` its weight-gradient half. The base class plays every stage
at once on a clock of ticks (a forward, an input-gradient or a weight-gradient pass takes one tick, a whole
backward two) and records the timetable: each computation's start tick, and each transfer's tick, the first tick
at or after its producer finished where neither end is in the middle of a computation.

Stage ``s``'s instructions have one step per tick at which it is free: the transfers of that tick (its results
out, its neighbours' in) posted as one group, loads where it holds the first or the last chunk, and the
computation it starts. A send and its receive sit in the step of the same tick on both stages, so a stage only
ever waits for a peer that is behind it on the clock: no order of completion can deadlock, whatever the real
durations (``schedule_check`` verifies it anyway).

Buffers are not reused within a batch (``chunk * micro_batches + micro_batch``): the engine frees a buffer's
tensors as soon as they are no longer needed, so buffer slots cost no memory.
"""

import functools

from deepspeed.runtime.pipe import schedule as S


class TimetableSchedule(S.PipeSchedule):
    """Base of the timetable schedules (module docstring)."""

    @classmethod
    def planner(cls, micro_batches, stages, chunks, *params):
        """An object with ``pick(stage, state)`` (the computation ``stage`` runs now, one that ``state.ready``
        accepts, or None to wait) and ``ops_per_micro_batch`` (computations per micro-batch and chunk)."""
        raise NotImplementedError

    def num_pipe_buffers(self):
        return self.chunks * self.micro_batches

    def _buffer(self, micro_batch, chunk):
        return chunk * self.micro_batches + micro_batch

    def table(self):
        """The timetable: ``(starts, transfers)``, ``starts[s]`` maps a tick to the computation stage ``s`` starts
        then, ``transfers`` maps a tick to ``[(producer stage, computation)]`` delivered then."""
        return _timetable(type(self), self.micro_batches, self.stages, self.chunks, self._params())

    def _params(self):
        """Extra arguments that change the table (hashable)."""
        return ()

    def steps(self):
        starts, transfers, free = self.table()
        me = self.stage_id
        last = self.virtual_stages - 1
        ticks = sorted(free[me])
        for i, t in enumerate(ticks):
            cmds = []
            for stage, op in transfers.get(t, ()):
                cmds += self._transfers(stage, op, me, last)
            if t in starts[me]:
                cmds += self._compute(starts[me][t], last)
            if i == len(ticks) - 1:
                cmds += [S.ReduceTiedGrads(), S.ReduceGrads(), S.OptimizerStep()]
            yield cmds

    def _kw(self, chunk):
        return {"chunk": chunk} if self.chunks > 1 else {}

    def _transfers(self, stage, op, me, last):
        """The instructions of ``me`` for what ``stage`` computed (``op``) in the previous step."""
        kind, mb, chunk = op
        vs = chunk * self.stages + stage
        out = []
        if kind == "F" and vs < last:
            peer, peer_chunk = self.owner(vs + 1)
            if stage == me:
                out.append(S.SendActivation(self._buffer(mb, chunk), **self._kw(chunk)))
            if peer == me:
                out.append(S.RecvActivation(self._buffer(mb, peer_chunk), **self._kw(peer_chunk)))
        if kind in ("B", "I") and vs > 0:
            peer, peer_chunk = self.owner(vs - 1)
            if stage == me:
                out.append(S.SendGrad(self._buffer(mb, chunk), **self._kw(chunk)))
            if peer == me:
                out.append(S.RecvGrad(self._buffer(mb, peer_chunk), **self._kw(peer_chunk)))
        return out

    def _compute(self, op, last):
        kind, mb, chunk = op
        vs = self.virtual_stage(chunk)
        buf, kw = self._buffer(mb, chunk), self._kw(chunk)
        if kind == "F":
            load = [S.LoadMicroBatch(buf, **kw)] if vs in (0, last) else []
            return load + [S.ForwardPass(buf, **kw)]
        if kind == "B":
            return [S.BackwardPass(buf, **kw)]
        if kind == "I":
            return [S.BackwardInputPass(buf, **kw)]
        return [S.BackwardWeightPass(buf, **kw)]


DURATION = {"F": 1, "B": 2, "I": 1, "W": 1}


class TimetableState:
    """What the stages have computed and received so far while the table is built."""

    def __init__(self, stages, chunks, micro_batches):
        self.stages, self.chunks, self.micro_batches = stages, chunks, micro_batches
        self.last = stages * chunks - 1
        self.started = set()  # (kind, vs, mb) started
        self.finished = set()  # (kind, vs, mb) whose result exists on its own stage
        self.arrived = set()  # (kind, vs, mb) whose result reached the neighbour that needs it
        self.tick = 0

    def vs(self, stage, chunk):
        return chunk * self.stages + stage

    def ready(self, stage, op):
        kind, mb, chunk = op
        vs = self.vs(stage, chunk)
        if (kind, vs, mb) in self.started:
            return False
        if kind == "F":
            return vs == 0 or ("F", vs - 1, mb) in self.arrived
        if kind in ("B", "I"):
            grad = vs == self.last or ("I", vs + 1, mb) in self.arrived or ("B", vs + 1, mb) in self.arrived
            return ("F", vs, mb) in self.finished and grad
        return ("I", vs, mb) in self.finished  # W

    def live(self, stage):
        """Micro-batches (x chunks) forwarded on ``stage`` whose weight gradient has not started."""
        count = 0
        for kind, vs, mb in self.started:
            if vs % self.stages == stage:
                count += 1 if kind == "F" else -1 if kind in ("B", "W") else 0
        return count


def _sends_to(op, stage, state):
    """The stage that needs the result of ``op`` run on ``stage`` (None: nobody)."""
    kind, mb, chunk = op
    vs = state.vs(stage, chunk)
    if kind == "F" and vs < state.last:
        return (vs + 1) % state.stages
    if kind in ("B", "I") and vs > 0:
        return (vs - 1) % state.stages
    return None


@functools.lru_cache(maxsize=256)
def _timetable(cls, micro_batches, stages, chunks, params):
    planner = cls.planner(micro_batches, stages, chunks, *params)
    state = TimetableState(stages, chunks, micro_batches)
    remaining = [micro_batches * chunks * planner.ops_per_micro_batch] * stages
    busy_until = [0] * stages
    running = {}  # stage -> (op, finish tick)
    pending = []  # (producer stage, op, consumer stage) produced, not delivered
    starts = [dict() for _ in range(stages)]
    free = [set() for _ in range(stages)]
    transfers = {}
    idle_ticks = 0
    while any(remaining) or running or pending:
        t = state.tick
        for stage, (op, finish) in list(running.items()):
            if finish == t:
                kind, mb, chunk = op
                state.finished.add((kind, state.vs(stage, chunk), mb))
                peer = _sends_to(op, stage, state)
                if peer is not None:
                    pending.append((stage, op, peer))
                del running[stage]
        at_boundary = [busy_until[s] <= t for s in range(stages)]
        delivered = [m for m in pending if at_boundary[m[0]] and at_boundary[m[2]]]
        for stage, op, peer in delivered:
            kind, mb, chunk = op
            state.arrived.add((kind, state.vs(stage, chunk), mb))
            transfers.setdefault(t, []).append((stage, op))
            pending.remove((stage, op, peer))
        progressed = bool(delivered)
        for stage in range(stages):
            if not at_boundary[stage]:
                continue
            free[stage].add(t)
            op = planner.pick(stage, state) if remaining[stage] else None
            if op is None:
                continue
            if not state.ready(stage, op):
                raise RuntimeError(f"{cls.__name__} picked {op} on stage {stage} before it was ready")
            state.started.add((op[0], state.vs(stage, op[2]), op[1]))
            starts[stage][t] = op
            busy_until[stage] = t + DURATION[op[0]]
            running[stage] = (op, busy_until[stage])
            remaining[stage] -= 1
            progressed = True
        idle_ticks = 0 if progressed or running else idle_ticks + 1
        if idle_ticks > 1:
            raise RuntimeError(f"{cls.__name__} cannot make progress at tick {t} ({stages} stages, {micro_batches} "
                               f"micro-batches, {chunks} chunks)")
        state.tick += 1
    end = state.tick
    for stage in range(stages):
        free[stage].add(end)  # the step that reduces and steps the optimizer
    return starts, transfers, free
