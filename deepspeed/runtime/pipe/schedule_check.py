# SPDX-License-Identifier: Apache-2.0
"""Check a pipeline schedule before it runs: every stage's instruction lists, run together on paper.

:func:`check_schedule` builds a schedule for every stage and plays them against each other the way
the engine runs them: within a step, consecutive transfer instructions form one group whose sends and
receives are posted together and complete together (``batch_isend_irecv``); a send completes when its
receiver has posted the matching receive; messages between two stages pair up in order. It follows
which micro-batch each buffer holds and raises :class:`ScheduleError` (naming the stage, step and
instruction) when

* the stages would wait on each other for ever (a deadlock), or a transfer pairs with one of another
  kind, chunk or micro-batch;
* a micro-batch's backward would run before its forward or before its output gradient arrived, a
  weight gradient before its input gradient, a buffer would be overwritten while still needed;
* some micro-batch is not forwarded and (for a training schedule) backpropagated exactly once on every
  model chunk, or the gradient reduction and optimizer step are not the last thing every stage does.

It returns a :class:`ScheduleReport` with each stage's finishing time under unit costs (``costs``:
forward, full backward, input-gradient and weight-gradient times), so that bubbles can be compared.
"""

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Dict, List

from deepspeed.runtime.pipe import schedule as sched_mod

DEFAULT_COSTS = {"forward": 1.0, "backward": 2.0, "backward_input": 1.0, "backward_weight": 1.0}


class ScheduleError(RuntimeError):
    """A schedule that would deadlock, pair the wrong transfers, or compute in the wrong order."""


@dataclass
class ScheduleReport:
    finish: List[float]  # per stage, when it finished under the cost model
    busy: List[float]  # per stage, time spent computing
    steps: List[int]  # per stage, number of steps
    peak_live: List[int] = field(default_factory=list)  # per stage, most micro-batches held for a backward

    @property
    def makespan(self):
        return max(self.finish)

    @property
    def bubble(self):
        """Idle time over the whole run, as a fraction of the makespan times the number of stages."""
        total = self.makespan * len(self.finish)
        return (total - sum(self.busy)) / total if total else 0.0


@dataclass
class _Buffer:
    chunk: int = None
    mb: int = None
    label: int = None
    forwarded: bool = False
    grad_in: bool = False
    input_grad: bool = False
    weight_grad: bool = False
    grad_sent: bool = False


def _chunk(instr):
    return instr.kwargs.get("chunk")


class _Stage:

    def __init__(self, schedule, training):
        self.s = schedule
        self.training = training
        self.items = []  # (step, kind, payload): kind "compute" (one instruction) or "comm" (a group)
        for step, cmds in enumerate(schedule):
            group = []
            for cmd in cmds:
                if isinstance(cmd, sched_mod.TRANSFERS):
                    group.append(cmd)
                    continue
                if group:
                    self.items.append((step, "comm", group))
                    group = []
                if not isinstance(cmd, sched_mod.CommitP2P):
                    self.items.append((step, "compute", cmd))
            if group:
                self.items.append((step, "comm", group))
        self.steps = len(list(schedule))
        self.pos = 0
        self.clock = 0.0
        self.busy = 0.0
        self.buffers = defaultdict(_Buffer)
        self.inputs_loaded = 0
        self.labels_loaded = 0
        self.posted = None  # the group being waited on: [(op, channel, index)] and when it was posted
        self.post_time = 0.0
        self.live = 0
        self.peak_live = 0

    @property
    def done(self):
        return self.pos >= len(self.items)

    def where(self):
        step, kind, payload = self.items[min(self.pos, len(self.items) - 1)]
        return f"stage {self.s.stage_id}, step {step}: {payload}"


class _Check:

    def __init__(self, make, stages, micro_batches, costs, training):
        self.stages = [_Stage(make(micro_batches, stages, s), training) for s in range(stages)]
        self.n = stages
        self.m = micro_batches
        self.costs = dict(DEFAULT_COSTS, **(costs or {}))
        self.training = training
        first = self.stages[0].s
        self.chunks = first.chunks
        self.vstages = first.virtual_stages
        self.channels = defaultdict(deque)  # (src, dst) -> messages sent, not yet received
        self.sent_count = defaultdict(int)  # (src, dst) -> sends posted
        self.recv_count = defaultdict(int)  # (src, dst) -> receives posted
        self.post_times = {}  # ("send"/"recv", src, dst, index) -> time posted
        self.forwarded = set()
        self.backwarded = set()
        self.weighted = set()
        self.stepped = [False] * stages

    def fail(self, stage, message):
        raise ScheduleError(f"{stage.where()}: {message}")

    # ------------------------------------------------------------------ compute
    def compute(self, st, cmd):
        s = st.s
        buf_id = cmd.kwargs.get("buffer_id")
        buf = st.buffers[buf_id] if buf_id is not None else None
        chunk = _chunk(cmd)
        if isinstance(cmd, sched_mod.LoadMicroBatch):
            first = s.virtual_stage(0 if chunk is None else chunk) == 0
            last = s.virtual_stage(s.chunks - 1 if chunk is None else chunk) == self.vstages - 1
            if not (first or last):
                self.fail(st, "LoadMicroBatch on a stage that holds neither the first nor the last model chunk")
            if first:
                self._claim(st, buf, 0 if chunk is None else chunk)
                buf.mb = st.inputs_loaded
                st.inputs_loaded += 1
            if last:
                buf.label = st.labels_loaded
                st.labels_loaded += 1
            return 0.0
        if isinstance(cmd, sched_mod.ForwardPass):
            c = chunk or 0
            vs = s.virtual_stage(c)
            if buf.mb is None or buf.chunk != c:
                self.fail(st, f"forward of a buffer without an input of chunk {c}")
            if buf.forwarded:
                self.fail(st, f"micro-batch {buf.mb} forwarded twice from one buffer")
            if vs == self.vstages - 1:
                if buf.label != buf.mb:
                    self.fail(st, f"the loss of micro-batch {buf.mb} would pair with the labels of {buf.label}")
                buf.label = None  # consumed
            if (vs, buf.mb) in self.forwarded:
                self.fail(st, f"micro-batch {buf.mb} forwarded twice on virtual stage {vs}")
            self.forwarded.add((vs, buf.mb))
            buf.forwarded = True
            if self.training:
                st.live += 1
                st.peak_live = max(st.peak_live, st.live)
            return self.costs["forward"]
        if isinstance(cmd, sched_mod.BACKWARDS):
            c = chunk or 0
            vs = s.virtual_stage(c)
            if not self.training:
                self.fail(st, "a backward in an inference schedule")
            if buf.mb is None or not buf.forwarded or buf.chunk != c:
                self.fail(st, "backward of a buffer whose forward has not run")
            if vs < self.vstages - 1 and not buf.grad_in:
                self.fail(st, f"backward of micro-batch {buf.mb} before its output gradient arrived")
            if (vs, buf.mb) in self.backwarded:
                self.fail(st, f"micro-batch {buf.mb} backpropagated twice on virtual stage {vs}")
            self.backwarded.add((vs, buf.mb))
            buf.input_grad = True
            if isinstance(cmd, sched_mod.BackwardPass):
                buf.weight_grad = True
                self.weighted.add((vs, buf.mb))
                st.live -= 1
                return self.costs["backward"]
            return self.costs["backward_input"]
        if isinstance(cmd, sched_mod.BackwardWeightPass):
            c = chunk or 0
            vs = s.virtual_stage(c)
            if not buf.input_grad or buf.weight_grad or buf.chunk != c:
                self.fail(st, "weight gradient without its input gradient (or twice)")
            buf.weight_grad = True
            self.weighted.add((vs, buf.mb))
            st.live -= 1
            return self.costs["backward_weight"]
        if isinstance(cmd, (sched_mod.ReduceTiedGrads, sched_mod.ReduceGrads)):
            return 0.0
        if isinstance(cmd, sched_mod.OptimizerStep):
            self.stepped[s.stage_id] = True
            return 0.0
        self.fail(st, f"unknown instruction {cmd!r}")

    def _claim(self, st, buf, chunk):
        """A buffer receives a new micro-batch: the one it held must be finished with."""
        if buf.mb is not None:
            finished = (not self.training and (buf.forwarded or buf.mb is None))
            if self.training:
                vs = st.s.virtual_stage(buf.chunk)
                finished = buf.weight_grad and (vs == 0 or buf.grad_sent)
            if not finished:
                self.fail(st, f"buffer overwritten while micro-batch {buf.mb} still needs it")
        label = buf.label  # labels are loaded into their own slot of the buffer, whenever the schedule says
        buf.__init__(chunk=chunk, label=label)

    # ------------------------------------------------------------------ transfers
    def _peer(self, st, cmd):
        s = st.s
        c = _chunk(cmd) or 0
        vs = s.virtual_stage(c)
        forward = isinstance(cmd, (sched_mod.SendActivation, sched_mod.RecvActivation))
        sending = isinstance(cmd, (sched_mod.SendActivation, sched_mod.SendGrad))
        # activations travel to vs + 1, gradients to vs - 1
        other = vs + 1 if forward == sending else vs - 1
        if not 0 <= other < self.vstages:
            self.fail(st, f"{cmd!r} has no peer (virtual stage {other})")
        rank, peer_chunk = s.owner(other)
        return rank, c, vs, other, peer_chunk

    def post(self, st, group):
        ops = []
        for cmd in group:
            rank, c, vs, other, _ = self._peer(st, cmd)
            me = st.s.stage_id
            if isinstance(cmd, (sched_mod.SendActivation, sched_mod.SendGrad)):
                buf = st.buffers[cmd.buffer_id]
                kind = "act" if isinstance(cmd, sched_mod.SendActivation) else "grad"
                if buf.mb is None or buf.chunk != c:
                    self.fail(st, f"{cmd!r}: the buffer holds nothing of chunk {c}")
                if kind == "act" and not buf.forwarded:
                    self.fail(st, f"{cmd!r}: micro-batch {buf.mb} not forwarded yet")
                if kind == "grad":
                    if not buf.input_grad:
                        self.fail(st, f"{cmd!r}: micro-batch {buf.mb} has no input gradient yet")
                    buf.grad_sent = True
                key = (me, rank)
                index = self.sent_count[key]
                self.sent_count[key] += 1
                self.channels[key].append((kind, buf.mb, other))
                ops.append(("send", key, index, cmd))
            else:
                key = (rank, me)
                index = self.recv_count[key]
                self.recv_count[key] += 1
                ops.append(("recv", key, index, cmd))
            self.post_times[(ops[-1][0], key, index)] = st.clock
        st.posted = ops
        st.post_time = st.clock

    def complete(self, st):
        """If every op of the posted group has its partner posted, apply the receives and return the time."""
        when = st.post_time
        for direction, key, index, _ in st.posted:
            partner = ("recv" if direction == "send" else "send", key, index)
            if partner not in self.post_times:
                return None
            when = max(when, self.post_times[partner])
        me = st.s.stage_id
        for direction, key, index, cmd in st.posted:
            if direction != "recv":
                continue
            if not self.channels[key]:
                self.fail(st, f"{cmd!r}: nothing was sent on stage {key[0]} -> {me}")
            kind, mb, vs = self.channels[key].popleft()
            want = "act" if isinstance(cmd, sched_mod.RecvActivation) else "grad"
            c = _chunk(cmd) or 0
            if kind != want or vs != st.s.virtual_stage(c):
                self.fail(
                    st, f"{cmd!r} pairs with a {kind} for virtual stage {vs} (micro-batch {mb}) sent by stage "
                    f"{key[0]}")
            buf = st.buffers[cmd.buffer_id]
            if want == "act":
                self._claim(st, buf, c)
                buf.mb = mb
            else:
                if buf.mb != mb or not buf.forwarded or buf.chunk != c:
                    self.fail(
                        st, f"{cmd!r}: the gradient of micro-batch {mb} arrives in a buffer holding "
                        f"micro-batch {buf.mb}")
                buf.grad_in = True
        st.posted = None
        return when

    # ------------------------------------------------------------------ run
    def run(self):
        while True:
            progress = False
            for st in self.stages:
                while not st.done:
                    step, kind, payload = st.items[st.pos]
                    if kind == "compute":
                        cost = self.compute(st, payload)
                        st.clock += cost
                        st.busy += cost
                        st.pos += 1
                        progress = True
                        continue
                    if st.posted is None:
                        self.post(st, payload)
                        progress = True
                    when = self.complete(st)
                    if when is None:
                        break
                    st.clock = when
                    st.pos += 1
                    progress = True
            if all(st.done for st in self.stages):
                break
            if not progress:
                waiting = "; ".join(st.where() for st in self.stages if not st.done)
                raise ScheduleError(f"deadlock: every unfinished stage waits on another ({waiting})")
        self._final_checks()
        return ScheduleReport(finish=[st.clock for st in self.stages],
                              busy=[st.busy for st in self.stages],
                              steps=[st.steps for st in self.stages],
                              peak_live=[st.peak_live for st in self.stages])

    def _final_checks(self):
        for key, queue in self.channels.items():
            if queue:
                raise ScheduleError(f"stage {key[0]} sent {len(queue)} message(s) to stage {key[1]} that were never "
                                    f"received")
        expected = {(vs, mb) for vs in range(self.vstages) for mb in range(self.m)}
        if self.forwarded != expected:
            missing = sorted(expected - self.forwarded)[:4]
            raise ScheduleError(f"forward passes missing: (virtual stage, micro-batch) {missing}")
        if not self.training:
            return
        if self.backwarded != expected or self.weighted != expected:
            missing = sorted(expected - (self.backwarded & self.weighted))[:4]
            raise ScheduleError(f"backward passes missing: (virtual stage, micro-batch) {missing}")
        for st in self.stages:
            tail = [payload for _, kind, payload in st.items if kind == "compute"]
            names = [type(c) for c in tail]
            if names.count(sched_mod.OptimizerStep) != 1 or not isinstance(tail[-1], sched_mod.OptimizerStep):
                raise ScheduleError(f"stage {st.s.stage_id}: the optimizer step must be its last instruction, once")
            last_grad = max(i for i, c in enumerate(tail)
                            if isinstance(c, sched_mod.BACKWARDS + (sched_mod.BackwardWeightPass, )))
            reduce_at = names.index(sched_mod.ReduceGrads) if sched_mod.ReduceGrads in names else -1
            if reduce_at < last_grad:
                raise ScheduleError(f"stage {st.s.stage_id}: ReduceGrads must follow its last backward")


def check_schedule(make, stages, micro_batches, costs=None, training=True):
    """Play ``make(micro_batches, stages, stage_id)`` for every stage (see the module docstring).

    Returns a :class:`ScheduleReport`; raises :class:`ScheduleError`.
    """
    return _Check(make, stages, micro_batches, costs, training).run()


def describe(make, stages, micro_batches) -> Dict[int, List[List[str]]]:
    """Every stage's steps as lists of instruction strings (for printing a schedule)."""
    return {s: [[repr(c) for c in cmds] for cmds in make(micro_batches, stages, s)] for s in range(stages)}
