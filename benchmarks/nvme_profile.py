# SPDX-License-Identifier: Apache-2.0
"""Where a ZeRO-3 NVMe-offload step's time goes (parameters and optimizer on disk), this package only.

    python benchmarks/nvme_profile.py --nvme-path /var/tmp/nvme_bench --out-dir OUT \
        --d-model 2048 --layers 8 --seq 2048 --micro-batch 4 --gas 2 --warmup 1 --profile-steps 2 --more-steps 6

Runs ``ds_zero3+nvme`` of ``benchmarks/systems.py`` (the keys ``nvme_bench.sh`` times): ``--warmup`` steps, then
``--profile-steps`` under ``torch.profiler`` (CPU and CUDA activities, all threads where this torch can), then up to
``--more-steps`` plain steps (as many as ``--deadline`` leaves time for), to see whether steps grow.

Nothing under ``deepspeed/`` changes: the script wraps, from outside, the functions of the disk tiers and the step
pipeline (``PagedStore`` submits, waits, acquires, flushes; the host Adam op; the step pipeline's waits; the
parameter gathers from disk) with wall-clock timers, and a sampler thread (every ``--sample-ms``) reads

* which aio requests are still in flight (``is_done`` of every submitted request: reads and writes of each tier),
  so the time the disk had a read, a write, both or nothing outstanding, and each request's latency;
* what the training thread and the host-step worker are doing (the innermost wrapped call each is in).

Per step (every step, profiled or not): wall time, bytes submitted per tier and direction, the sampled states,
the timers, ``/proc/diskstats`` of the swap folder's device (sectors, busy ms), the process's CPU seconds (training
thread, host-step worker, the rest: aio and OpenMP threads), host RSS, ``Dirty``/``Writeback``/``Cached``.

Files in ``--out-dir``: ``nvme_profile_steps.jsonl`` (one line a step), ``nvme_profile_summary.md`` (the tables
and the fractions), ``nvme_profile_cpu_top40.txt`` and ``nvme_profile_cuda_top40.txt`` (the profiled steps'
``key_averages``, by self CPU time and by CUDA time), ``nvme_profile_timeline.txt`` (the first profiled step in
100 ms bins: disk reads/writes outstanding, the two threads' states, GPU kernel and copy busy).
"""

import argparse
import collections
import contextlib
import json
import os
import sys
import threading
import time

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)
# NVP_DS_ROOT: a folder holding another ``deepspeed`` (and its ``csrc``), imported instead of this checkout's (the
# committed tree while the checkout has edits in progress); ``benchmarks`` still comes from here
if os.environ.get("NVP_DS_ROOT"):
    sys.path.insert(0, os.path.abspath(os.environ["NVP_DS_ROOT"]))

import torch  # noqa: E402

from benchmarks.gpt import GPT, GPTConfig, count_params, lm_loss  # noqa: E402
from benchmarks.systems import make_system  # noqa: E402
from benchmarks.train_bench import SEED, init_distributed, make_data  # noqa: E402

now = time.perf_counter


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nvme-path", default=None, help="the swap folder (required unless --from-steps)")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--gas", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--more-steps",
                    type=int,
                    default=6,
                    help="plain steps after the profiled ones (deadline allowing)")
    ap.add_argument("--deadline", type=float, default=0.0, help="epoch seconds: no step starts that would end later")
    ap.add_argument("--sample-ms", type=float, default=5.0)
    ap.add_argument("--bucket-size", type=float, default=5e7)
    ap.add_argument("--unit-size", type=float, default=4e7)
    ap.add_argument("--ds-extra", type=json.loads, default={})
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pg-timeout-min", type=float, default=10.0)
    ap.add_argument("--from-steps",
                    default=None,
                    metavar="JSONL",
                    help="only write the summary of an earlier run's nvme_profile_steps.jsonl (no GPU, no model)")
    args = ap.parse_args(argv)
    args.steps = args.profile_steps + args.more_steps  # make_data makes warmup + steps steps of data
    return args


# ----------------------------------------------------------------------------------------------- recording
class Recorder:
    """Per-step accumulators, thread-safe: timers by (thread role, key), bytes by key, sampled states."""

    def __init__(self):
        self.lock = threading.Lock()
        self.main_ident = threading.main_thread().ident
        self.stacks = {}  # thread ident -> [state, ...] (innermost last)
        self.live = []  # tickets in flight
        self.reset()

    def reset(self):
        with self.lock:
            self.timers = collections.defaultdict(lambda: [0, 0.0])
            self.bytes = collections.defaultdict(int)
            self.requests = collections.defaultdict(int)
            self.latency = collections.defaultdict(lambda: [0, 0.0, 0.0])  # count, sum, max
            self.states = collections.defaultdict(float)  # (role, state) -> seconds (sampled)
            self.disk = collections.defaultdict(float)  # read / write / both / none -> seconds (sampled)
            self.inflight_bytes = [0.0, 0.0]  # byte-seconds of reads, writes outstanding (for mean depth)
            self.samples = []  # (t, reads, writes, main state, host state) while self.keep_samples
            self.keep_samples = False

    @staticmethod
    def role():
        t = threading.current_thread()
        if t is threading.main_thread():
            return "main"
        if t.name == "ds-host-step":
            return "host"
        return t.name

    def add(self, key, dt, role=None):
        role = role or self.role()
        with self.lock:
            entry = self.timers[(role, key)]
            entry[0] += 1
            entry[1] += dt

    def push(self, state):
        ident = threading.get_ident()
        stack = self.stacks.get(ident)
        if stack is None:
            stack = self.stacks[ident] = []
        stack.append(state)

    def pop(self):
        stack = self.stacks.get(threading.get_ident())
        if stack:
            stack.pop()

    def state_of(self, ident):
        stack = self.stacks.get(ident)
        return stack[-1] if stack else "-"

    def snapshot(self):
        with self.lock:
            return dict(timers={
                f"{r}:{k}": [n, round(s, 4)]
                for (r, k), (n, s) in sorted(self.timers.items())
            },
                        bytes=dict(self.bytes),
                        requests=dict(self.requests),
                        latency={
                            k: [n, round(s / max(n, 1), 4), round(m, 4)]
                            for k, (n, s, m) in self.latency.items()
                        },
                        states={
                            f"{r}:{k}": round(s, 4)
                            for (r, k), s in sorted(self.states.items())
                        },
                        disk={
                            k: round(v, 4)
                            for k, v in self.disk.items()
                        },
                        mean_inflight_gib=[round(x, 4) for x in self.inflight_bytes])


REC = Recorder()


def _profiling():
    return torch.autograd.profiler._is_profiler_enabled


def timed(key_fn):
    """A decorator factory: time the call under ``key_fn(*args)`` (a string), mark the thread's state, and open a
    profiler range ``NVP::<key>`` while a profiler records."""

    def deco(fn):

        def wrapper(*a, **k):
            key = key_fn(*a) if callable(key_fn) else key_fn
            REC.push(key)
            ctx = torch.profiler.record_function("NVP::" + key) if _profiling() else contextlib.nullcontext()
            t = now()
            try:
                with ctx:
                    return fn(*a, **k)
            finally:
                REC.add(key, now() - t)
                REC.pop()

        wrapper.__wrapped__ = fn
        return wrapper

    return deco


def _tier(store):
    return "opt" if "fp32" in store.fields else "param"


def instrument():
    """Wrap the disk tiers, the host Adam op and the step pipeline's waits (see the module docstring)."""
    from deepspeed.ops.adam import host_adam
    from deepspeed.ops.aio.buffers import aligned_numel
    from deepspeed.runtime.swap_tensor import optimizer_swap, paged_store, param_swap
    from deepspeed.runtime.zero.offload import step_pipeline, unit_step

    PS = paged_store.PagedStore
    tls = threading.local()

    class TimedTicket(paged_store._Ticket):
        __slots__ = ("kind", "nbytes", "t0", "t_done")

        def __init__(self, io, ids):
            super().__init__(io, ids)
            self.kind = getattr(tls, "kind", None) or "other"
            self.nbytes = getattr(tls, "nbytes", 0)
            self.t0 = now()
            self.t_done = None
            with REC.lock:
                REC.live.append(self)

        def wait(self):
            if self.done:
                return super().wait()
            REC.push("wait_" + self.kind)
            ctx = torch.profiler.record_function("NVP::wait_" +
                                                 self.kind) if _profiling() else contextlib.nullcontext()
            t = now()
            try:
                with ctx:
                    return super().wait()
            finally:
                t1 = now()
                REC.add("wait_" + self.kind, t1 - t)
                REC.pop()
                if self.t_done is None:
                    self.t_done = t1

    paged_store._Ticket = TimedTicket

    sizes = {}

    def page_bytes(store, page):
        key = (id(store), page)
        if key not in sizes:
            length = store.table.pages[page][2]
            sizes[key] = sum(
                aligned_numel(length, dt) * torch.empty((), dtype=dt).element_size() for dt in store.fields.values())
        return sizes[key]

    submit = PS._submit

    def _submit(self, write, page, slot):
        kind = f"{_tier(self)}_{'write' if write else 'read'}"
        nbytes = page_bytes(self, page)
        tls.kind, tls.nbytes = kind, nbytes
        t = now()
        try:
            return submit(self, write, page, slot)
        finally:
            tls.kind = None
            REC.add("submit_" + kind, now() - t)
            with REC.lock:
                REC.bytes[kind] += nbytes
                REC.requests[kind] += 1

    PS._submit = _submit
    PS.acquire = timed(lambda self, *a: f"acquire_{_tier(self)}")(PS.acquire)
    PS.flush = timed(lambda self, *a: f"flush_{_tier(self)}")(PS.flush)
    PS.prefetch = timed(lambda self, *a: f"prefetch_{_tier(self)}")(PS.prefetch)
    PS._drain = staticmethod(timed("drain_evicted")(PS.__dict__["_drain"].__func__))
    host_adam.step_piece = timed("adam")(host_adam.step_piece)  # looked up on the module at each call
    OS = optimizer_swap.OptimizerStateSwap
    OS.step_range = timed("opt_step_range")(OS.step_range)
    OS.swap_in = timed("opt_swap_in")(OS.swap_in)
    OS.swap_out = timed("opt_swap_out")(OS.swap_out)
    OS.finish_step = timed("opt_finish_step")(OS.finish_step)
    PSw = param_swap.ParamShardSwap
    PSw.fetch_row = timed("param_fetch_row")(PSw.fetch_row)
    PSw.open_target = timed("param_open_target")(PSw.open_target)
    PSw.swap_in = timed("param_swap_in")(PSw.swap_in)
    PSw.swap_out = timed("param_swap_out")(PSw.swap_out)
    PSw.finish_writes = timed("param_finish_writes")(PSw.finish_writes)
    SP = step_pipeline.StepPipeline
    SP.finish = timed("pipeline_finish")(SP.finish)
    SP.wait_through = timed("pipeline_wait_through")(SP.wait_through)
    SP.step_piece = timed("step_piece")(SP.step_piece)
    US = unit_step.UnitStep
    US.wait_for = timed("unit_wait_for_step")(US.wait_for)
    US.launch = timed("unit_step_launch")(US.launch)


class Sampler(threading.Thread):
    """Every ``period`` s: in-flight aio requests (completion times, latencies, disk occupancy) and the states of the
    training thread and the host-step worker."""

    def __init__(self, period):
        super().__init__(name="nvp-sampler", daemon=True)
        self.period = period
        self.stopping = False
        self.host_ident = None

    def run(self):
        last = now()
        while not self.stopping:
            time.sleep(self.period)
            t = now()
            dt = t - last
            last = t
            with REC.lock:
                live = list(REC.live)
            reads = writes = 0
            read_bytes = write_bytes = 0
            finished = []
            for ticket in live:
                if ticket.t_done is None:
                    try:
                        if ticket.done or all(ticket.io.is_done(i) for i in ticket.ids):
                            ticket.t_done = t
                    except Exception:
                        ticket.t_done = t
                if ticket.t_done is not None:
                    finished.append(ticket)
                elif ticket.kind.endswith("read"):
                    reads += 1
                    read_bytes += ticket.nbytes
                else:
                    writes += 1
                    write_bytes += ticket.nbytes
            if self.host_ident is None:
                for th in threading.enumerate():
                    if th.name == "ds-host-step":
                        self.host_ident = th.ident
            main_state = REC.state_of(REC.main_ident)
            host_state = REC.state_of(self.host_ident) if self.host_ident else "-"
            with REC.lock:
                for ticket in finished:
                    try:
                        REC.live.remove(ticket)
                    except ValueError:
                        continue
                    lat = REC.latency[ticket.kind]
                    d = ticket.t_done - ticket.t0
                    lat[0] += 1
                    lat[1] += d
                    lat[2] = max(lat[2], d)
                key = "both" if reads and writes else "read" if reads else "write" if writes else "none"
                REC.disk[key] += dt
                REC.inflight_bytes[0] += read_bytes * dt / 2**30
                REC.inflight_bytes[1] += write_bytes * dt / 2**30
                REC.states[("main", main_state)] += dt
                REC.states[("host", host_state)] += dt
                if REC.keep_samples:
                    REC.samples.append((t, reads, writes, main_state, host_state))


# ------------------------------------------------------------------------------------------ system probes
def disk_of(path):
    """The ``/proc/diskstats`` name of the block device holding ``path`` (its whole disk where it is a partition)."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    try:
        with open(f"/sys/dev/block/{major}:{minor}/uevent") as f:
            name = dict(line.strip().split("=", 1) for line in f if "=" in line).get("DEVNAME")
        return name
    except OSError:
        return None


def diskstats(name):
    """``{reads, read_sectors, read_ms, writes, write_sectors, write_ms, busy_ms, queue_ms}`` of ``name``."""
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                p = line.split()
                if len(p) > 13 and p[2] == name:
                    v = [int(x) for x in p[3:14]]
                    return dict(reads=v[0],
                                read_sectors=v[2],
                                read_ms=v[3],
                                writes=v[4],
                                write_sectors=v[6],
                                write_ms=v[7],
                                busy_ms=v[9],
                                queue_ms=v[10])
    except OSError:
        pass
    return None


def meminfo():
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("Dirty", "Writeback", "Cached", "MemFree", "MemAvailable"):
                    out[k] = round(int(v.split()[0]) / 2**20, 3)  # GiB
    except OSError:
        pass
    return out


def thread_cpu(host_ident_native):
    """CPU seconds (user + system) of this process's threads: the training thread, the host-step worker, the rest."""
    tick = os.sysconf("SC_CLK_TCK")
    main_native = threading.main_thread().native_id
    out = collections.defaultdict(float)
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            cpu = (int(fields[11]) + int(fields[12])) / tick
            t = int(tid)
            out["main" if t == main_native else "host" if t == host_ident_native else "other"] += cpu
    except OSError:
        pass
    return dict(out)


def delta(a, b):
    if a is None or b is None:
        return None
    return {k: b[k] - a[k] for k in a}


# ---------------------------------------------------------------------------------------------- the steps
def run_step(engine, micro_batches):
    total = 0.0
    for tokens, targets in micro_batches:
        with _phase("forward"):
            loss = lm_loss(engine(tokens), targets)
        with _phase("backward"):
            engine.backward(loss)
        with _phase("engine_step"):
            engine.step()
        total = total + loss.detach()
    return total / len(micro_batches)


@contextlib.contextmanager
def _phase(name):
    REC.push(name)
    ctx = torch.profiler.record_function("NVP::" + name) if _profiling() else contextlib.nullcontext()
    t = now()
    try:
        with ctx:
            yield
    finally:
        REC.add(name, now() - t)
        REC.pop()


def _profiler(device):
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if os.environ.get("NVP_ALL_THREADS", "1") == "0":
        return profile(activities=activities), False
    try:
        from torch._C._profiler import _ExperimentalConfig
        return profile(activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True)), True
    except (ImportError, TypeError, RuntimeError):
        return profile(activities=activities), False


def device_busy(prof, t0_us=None):
    """(kernel busy s, copy busy s, union s, intervals) of the profiled device activity (unions of intervals)."""
    kernels, copies = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.time_range.end <= e.time_range.start:
            continue
        if getattr(e, "is_user_annotation", False) or e.name.startswith(("DS::", "NVP::")):
            continue
        iv = (e.time_range.start, e.time_range.end)
        (copies if "memcpy" in e.name.lower() or "memset" in e.name.lower() else kernels).append(iv)

    def union(ivs):
        busy, cur = 0.0, None
        for lo, hi in sorted(ivs):
            if cur is None or lo > cur[1]:
                if cur is not None:
                    busy += cur[1] - cur[0]
                cur = [lo, hi]
            else:
                cur[1] = max(cur[1], hi)
        if cur is not None:
            busy += cur[1] - cur[0]
        return busy / 1e6

    return union(kernels), union(copies), union(kernels + copies), kernels, copies


def key_tables(prof, out_dir, note):
    table = prof.key_averages()
    with open(os.path.join(out_dir, "nvme_profile_cpu_top40.txt"), "w") as f:
        f.write(note + "\n\n")
        f.write(table.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=55))
    with open(os.path.join(out_dir, "nvme_profile_cuda_top40.txt"), "w") as f:
        f.write(note + "\n\n")
        text = None
        for key in ("device_time_total", "cuda_time_total"):
            try:
                text = table.table(sort_by=key, row_limit=40, max_name_column_width=55)
                break
            except Exception as exc:  # noqa: BLE001 (the key's name changed across torch versions)
                text = f"(sort_by={key}: {exc})"
        f.write(text)
    return table


def timeline(samples, t0, t1, kernels, copies, prof_t0_us, wall_t0, bin_s=0.1):
    """The first profiled step in ``bin_s`` bins: share of samples with reads / writes in flight, the two threads'
    most frequent states, the GPU's kernel and copy busy shares."""
    nbins = max(1, int((t1 - t0) / bin_s) + 1)
    rows = [dict(r=0, w=0, n=0, main=collections.Counter(), host=collections.Counter()) for _ in range(nbins)]
    for t, r, w, ms, hs in samples:
        if t0 <= t < t1:
            b = rows[int((t - t0) / bin_s)]
            b["n"] += 1
            b["r"] += r > 0
            b["w"] += w > 0
            b["main"][ms] += 1
            b["host"][hs] += 1
    gk = [0.0] * nbins
    gc = [0.0] * nbins
    for ivs, acc in ((kernels, gk), (copies, gc)):
        for lo, hi in ivs:
            # profiler microseconds -> seconds on the perf_counter clock of wall_t0
            s = (lo - prof_t0_us) / 1e6 + wall_t0 - t0
            e = (hi - prof_t0_us) / 1e6 + wall_t0 - t0
            # the bins the interval overlaps (a bounded loop: stepping by the overlap can stall on a float boundary)
            for b in range(max(0, int(s / bin_s)), min(nbins, int(e / bin_s) + 1)):
                acc[b] += max(0.0, min(e, (b + 1) * bin_s) - max(s, b * bin_s))
    lines = [
        f"bin {bin_s * 1e3:.0f} ms | reads% | writes% | GPU kernels% | GPU copies% | main thread | host-step worker"
    ]
    for i, b in enumerate(rows):
        n = max(b["n"], 1)
        main = b["main"].most_common(1)[0][0] if b["main"] else "-"
        host = b["host"].most_common(1)[0][0] if b["host"] else "-"
        lines.append(f"{i * bin_s:6.1f} | {100 * b['r'] / n:3.0f} | {100 * b['w'] / n:3.0f} | "
                     f"{min(100, 100 * gk[i] / bin_s):3.0f} | {min(100, 100 * gc[i] / bin_s):3.0f} | {main} | {host}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.from_steps:
        with open(args.from_steps) as f:
            records = [json.loads(line) for line in f if line.strip()]
        summary = summarize(args, records, {}, None, None, None, None)
        with open(os.path.join(args.out_dir, "nvme_profile_summary.md"), "w") as f:
            f.write(summary + "\n")
        print(summary)
        return
    if not args.nvme_path:
        raise SystemExit("nvme_profile: --nvme-path is required")
    device = init_distributed(args)
    import deepspeed
    print(f"nvme_profile: deepspeed {deepspeed.__version__} from {os.path.dirname(deepspeed.__file__)}", flush=True)
    instrument()
    cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, vocab=args.vocab, seq=args.seq)
    data = make_data(args, 0, device)
    hp = dict(micro_batch=args.micro_batch,
              gas=args.gas,
              lr=1e-4,
              weight_decay=0.1,
              betas=(0.9, 0.95),
              clip=1.0,
              bucket_size=int(args.bucket_size),
              unit_size=int(args.unit_size),
              ds_extra=args.ds_extra,
              pin_memory=True,
              nvme_path=args.nvme_path)
    torch.manual_seed(SEED)
    t = now()
    with torch.device(device):
        model = GPT(cfg)
    n_params = count_params(model)[0]
    system = make_system("ds_zero3+nvme", model, hp, device)
    del model
    setup_s = now() - t
    engine = system.engine
    print(f"nvme_profile: {n_params / 1e9:.3f}e9 parameters, set up in {setup_s:.1f} s", flush=True)
    disk = disk_of(args.nvme_path)
    tiers = {}
    stage = getattr(engine, "_stage", None) or engine.optimizer
    host_step = getattr(stage, "host_step", None)
    for name, tier in (("opt", getattr(host_step, "swap", None)), ("param", getattr(stage, "param_tier", None))):
        if tier is not None:
            st = tier.store
            tiers[name] = dict(slots=st.slots,
                               pages=len(st.table.pages),
                               page_numel=st.table.page_numel,
                               cache_gib=round(st.nbytes() / 2**30, 3),
                               file_gib=round(sum(st.file_bytes.values()) / 2**30, 3),
                               backend=getattr(tier.io, "backend",
                                               type(tier.io).__name__),
                               io_threads=getattr(tier.io, "threads", None))
    print(f"nvme_profile: disk {disk}; tiers {json.dumps(tiers)}", flush=True)
    sampler = Sampler(args.sample_ms / 1e3)
    sampler.start()
    steps_path = os.path.join(args.out_dir, "nvme_profile_steps.jsonl")
    records = []
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    prof_info = {}
    total = args.warmup + args.profile_steps + args.more_steps
    prof = None
    with open(steps_path, "w") as out:
        for i in range(total):
            kind = "warmup" if i < args.warmup else "profiled" if i < args.warmup + args.profile_steps else "plain"
            if kind == "plain" and args.deadline and records:
                last = max(r["wall_s"] for r in records[-2:])
                if time.time() + 1.5 * last + 10 > args.deadline:
                    print(f"nvme_profile: stop before step {i + 1}: the deadline is near", flush=True)
                    break
            if kind == "profiled" and i == args.warmup:
                prof, all_threads = _profiler(device)
                prof.__enter__()
                prof_info["all_threads"] = all_threads
                prof_info["t0_wall"] = now()
                prof_info["t0_us"] = None
            sync()
            host_native = next((th.native_id for th in threading.enumerate() if th.name == "ds-host-step"), None)
            d0, c0 = diskstats(disk), thread_cpu(host_native)
            REC.reset()
            REC.keep_samples = kind == "profiled" and i == args.warmup
            t0 = now()
            loss = run_step(engine, data[i])
            sync()
            t1 = now()
            snap = REC.snapshot()
            samples = REC.samples if REC.keep_samples else None
            REC.keep_samples = False
            d1, c1 = diskstats(disk), thread_cpu(host_native)
            rec = dict(step=i + 1,
                       kind=kind,
                       wall_s=round(t1 - t0, 4),
                       loss=round(float(loss), 5),
                       **snap,
                       diskstats=delta(d0, d1),
                       cpu_s={k: round(c1.get(k, 0) - c0.get(k, 0), 3)
                              for k in c1},
                       rss_gib=round(_rss(), 3),
                       meminfo=meminfo())
            if samples is not None:
                prof_info["first"] = (t0, t1, samples)
            records.append(rec)
            out.write(json.dumps(rec) + "\n")
            out.flush()
            print(
                f"nvme_profile: step {i + 1} ({kind}) {t1 - t0:.3f} s, loss {float(loss):.4f}, "
                f"bytes {json.dumps({k: round(v / 2**30, 2) for k, v in snap['bytes'].items()})} GiB, "
                f"disk {json.dumps(snap['disk'])}",
                flush=True)
            if kind == "profiled" and i == args.warmup + args.profile_steps - 1:
                prof.__exit__(None, None, None)
                prof_info["wall"] = t1 - prof_info["t0_wall"]
                t = now()
                note = (f"{args.profile_steps} profiled steps (after {args.warmup} warm-up), wall "
                        f"{prof_info['wall']:.3f} s; all threads: {prof_info['all_threads']}")
                key_tables(prof, args.out_dir, note)
                k, c, u, kernels, copies = device_busy(prof)
                prof_info.update(kernel_s=k, copy_s=c, busy_s=u)
                first = prof_info.get("first")
                if first:
                    # kineto's clock: microseconds since the epoch on most builds; align on the profile's start
                    base = 0  # FunctionEvent times are microseconds from the trace start
                    text = timeline(first[2], first[0], first[1], kernels, copies, base, prof_info["t0_wall"])
                    with open(os.path.join(args.out_dir, "nvme_profile_timeline.txt"), "w") as f:
                        f.write(f"step {args.warmup + 1} (the first profiled), {first[1] - first[0]:.3f} s; bins "
                                f"from the step's start; GPU columns aligned on the profile's first event "
                                f"(~the profiler's start)\n")
                        f.write(text + "\n")
                print(
                    f"nvme_profile: profiler tables written in {now() - t:.1f} s; device kernels {k:.3f} s, "
                    f"copies {c:.3f} s, union {u:.3f} s over {prof_info['wall']:.3f} s",
                    flush=True)
                prof = None
    sampler.stopping = True
    summary = summarize(args, records, prof_info, tiers, disk, n_params, setup_s)
    with open(os.path.join(args.out_dir, "nvme_profile_summary.md"), "w") as f:
        f.write(summary + "\n")
    print(summary, flush=True)
    sys.stdout.flush()
    os._exit(0)  # the engine's files are removed by the caller; no teardown to wait for


def _rss():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def summarize(args, records, prof_info, tiers, disk, n_params, setup_s):
    lines = ["# NVMe offload step profile: ZeRO-3, parameters and optimizer on NVMe, this package only", ""]
    if args.from_steps:
        lines.append(f"- written from {args.from_steps} (--from-steps); the model and tiers are in that run's log")
    else:
        lines.append(f"- model: d_model {args.d_model}, {args.layers} layers, seq {args.seq}, micro-batch "
                     f"{args.micro_batch}, GAS {args.gas}: {n_params / 1e9:.3f}e9 parameters; set-up {setup_s:.1f} s")
        lines.append(f"- disk tiers: {json.dumps(tiers)}; swap device {disk}")
    lines.append(f"- steps: {args.warmup} warm-up, {args.profile_steps} profiled, then plain ones; sampler every "
                 f"{args.sample_ms} ms")
    lines.append("")
    lines.append("## Steps")
    lines.append("")
    lines.append("| step | kind | wall (s) | opt read GiB | opt write GiB | param read GiB | param write GiB | "
                 "disk: read only / write only / both / idle (s) | diskstats MB/s r / w | disk busy % | "
                 "mean in flight GiB r / w | CPU s main / host / other | loss |")
    lines.append("| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | --- | --- | ---: |")
    for r in records:
        b = r["bytes"]
        g = lambda k: f"{b.get(k, 0) / 2**30:.2f}"  # noqa: E731
        dk = r["disk"]
        ds = r["diskstats"] or {}
        w = r["wall_s"]
        rd = ds.get("read_sectors", 0) * 512 / 1e6 / w if ds else 0
        wr = ds.get("write_sectors", 0) * 512 / 1e6 / w if ds else 0
        busy = 100 * ds.get("busy_ms", 0) / 1e3 / w if ds else 0
        mi = r["mean_inflight_gib"]
        cpu = r["cpu_s"]
        lines.append(f"| {r['step']} | {r['kind']} | {w:.3f} | {g('opt_read')} | {g('opt_write')} | "
                     f"{g('param_read')} | {g('param_write')} | {dk.get('read', 0):.2f} / {dk.get('write', 0):.2f} / "
                     f"{dk.get('both', 0):.2f} / {dk.get('none', 0):.2f} | {rd:.0f} / {wr:.0f} | {busy:.0f} | "
                     f"{mi[0] / w:.2f} / {mi[1] / w:.2f} | {cpu.get('main', 0):.1f} / {cpu.get('host', 0):.1f} / "
                     f"{cpu.get('other', 0):.1f} | {r['loss']:.4f} |")
    lines.append("")
    timed_records = [r for r in records if r["kind"] != "warmup"]
    if not timed_records:
        return "\n".join(lines)
    lines.append("## Where each thread's time goes (sampled states, share of the step's wall time; mean over the "
                 "non-warm-up steps)")
    lines.append("")
    states = collections.defaultdict(float)
    wall = sum(r["wall_s"] for r in timed_records)
    for r in timed_records:
        for k, v in r["states"].items():
            states[k] += v
    for role in ("main", "host"):
        items = sorted(((k.split(":", 1)[1], v) for k, v in states.items() if k.startswith(role + ":")),
                       key=lambda kv: -kv[1])
        lines.append(f"- {role}: " + ", ".join(f"{k} {100 * v / wall:.1f}%" for k, v in items[:12]))
    lines.append("")
    lines.append("## Timers (wall s per step, mean over the non-warm-up steps; inclusive: a call's time holds its "
                 "nested calls')")
    lines.append("")
    lines.append("| thread:call | calls/step | s/step | share of step |")
    lines.append("| --- | ---: | ---: | ---: |")
    timers = collections.defaultdict(lambda: [0, 0.0])
    for r in timed_records:
        for k, (n, s) in r["timers"].items():
            timers[k][0] += n
            timers[k][1] += s
    n = len(timed_records)
    for k, (c, s) in sorted(timers.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {k} | {c / n:.1f} | {s / n:.3f} | {100 * s / wall:.1f}% |")
    lines.append("")
    lat = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in timed_records:
        for k, (c, mean, mx) in r["latency"].items():
            lat[k][0] += c
            lat[k][1] += c * mean
            lat[k][2] = max(lat[k][2], mx)
    lines.append("- aio request latency (submit to completion, sampled): " +
                 ", ".join(f"{k} {c / n:.0f}/step mean {1e3 * s / max(c, 1):.0f} ms max {1e3 * m:.0f} ms"
                           for k, (c, s, m) in sorted(lat.items())))
    if prof_info.get("wall"):
        lines.append(
            f"- profiled steps: wall {prof_info['wall']:.3f} s; GPU kernels busy {prof_info['kernel_s']:.3f} s "
            f"({100 * prof_info['kernel_s'] / prof_info['wall']:.1f}%), copies {prof_info['copy_s']:.3f} s, "
            f"union {prof_info['busy_s']:.3f} s ({100 * prof_info['busy_s'] / prof_info['wall']:.1f}%); "
            f"profiler on all threads: {prof_info.get('all_threads')}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
