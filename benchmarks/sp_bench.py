# SPDX-License-Identifier: Apache-2.0
"""Long-sequence benchmark with the ALST memory tools: a Llama-3.2-1B-shaped model on one GPU (sp 1).

    python benchmarks/sp_bench.py --impl both --upstream-path /tmp/upstream --out sp_bench.json

A random-weight ``LlamaForCausalLM`` with Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 query / 8 key-value
heads, vocabulary 128256; sdpa attention), its embeddings untied (``--tied`` ties them as the released model does:
upstream 0.19.8's ZeRO-3 then fails an assertion in its gradient bucket when ``TiledFusedLogitsLoss``'s
forward-time gradient of the tied weight meets the embedding's), bf16, ZeRO-3, AdamW (lr 1e-5, no weight decay,
gradient clipping 1.0), micro-batch 1. The ALST tools are on for each implementation with its own code: ``TiledMLP``
on every MLP (tiles of ``hidden`` tokens), ``TiledFusedLogitsLoss`` for the loss (tiles of ``--logits-tile`` tokens,
so the ``[tokens, vocab]`` logits never exist at once; each tile returns its share of the mean) and checkpointed
decoder layers whose inputs wait on the host (this package: ``enable_checkpoint_offload``; upstream, which has none
of its own in the package: Transformers' ``gradient_checkpointing_enable(offload=True)``).

Search, per implementation, in one process: a training step (forward, backward, optimizer step) at ``--start``
tokens, doubling until one runs out of memory, then bisecting between the last success and the first failure down
to ``--resolution`` tokens. A step that runs out of memory is followed by a fresh engine. ``--time-budget`` seconds
bound each search (a step's time grows with the square of its length: a search stopped by time reports its longest
success as a lower bound, ``capped``). Then the tokens/s of this implementation at ``--compare-at`` tokens (default:
the upstream run's longest length when ``--impl both`` ran upstream first; else the longest success), from one
step after a warm-up step (``--measure-steps N``: the median of N steps after it, each step's time recorded).
Every step's length, time, peak memory (``max_memory_allocated``) and outcome is recorded.

``--impl both`` runs upstream first (its longest length sets the comparison length), then this package, each in
its own process (``--upstream-path`` holds upstream's installed package; this package comes from this repository),
and writes one JSON file with both.
"""

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LLAMA_3_2_1B = dict(vocab_size=128256,
                    hidden_size=2048,
                    intermediate_size=8192,
                    num_hidden_layers=16,
                    num_attention_heads=32,
                    num_key_value_heads=8,
                    head_dim=64,
                    rope_theta=500000.0,
                    rms_norm_eps=1e-5,
                    tie_word_embeddings=False)
# --tiny: the same code path on a toy model (a CPU smoke test of the benchmark itself).
TINY = dict(LLAMA_3_2_1B,
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16)


def _shape(args):
    shape = dict(TINY if args.tiny else LLAMA_3_2_1B, tie_word_embeddings=bool(args.tied))
    if getattr(args, "layers", 0):
        shape["num_hidden_layers"] = args.layers
    return shape


def _device(args):
    import torch
    return torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")


def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ one process
def _build(args, impl):
    import torch
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama
    ulysses = __import__("deepspeed.runtime.sequence_parallel.ulysses_sp", fromlist=["TiledMLP"])

    def tiled_mlp_forward(self, x):
        shards = max(1, math.ceil(x.shape[-2] / self.config.hidden_size))

        def mlp(module, h):
            return module.down_proj(module.act_fn(module.gate_proj(h)) * module.up_proj(h))

        params = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]
        return ulysses.TiledMLP.apply(mlp, self, x, shards, params)

    tiled_layers = impl == "ours" and not args.no_tiled_layers
    if not tiled_layers:  # (a tiled layer runs its MLP in tiles already)
        modeling_llama.LlamaMLP.forward = tiled_mlp_forward
    config = LlamaConfig(**_shape(args),
                         max_position_embeddings=max(args.start * 256, 1 << 22),
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with _device(args):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    if impl == "ours":
        from deepspeed.runtime.sequence_parallel.activation_offload import enable_checkpoint_offload
        enable_checkpoint_offload(model)
        from deepspeed.runtime.sequence_parallel.recompute import enable_recompute_in_backward
        if tiled_layers:  # token-wise parts in tiles around the attention (runtime/sequence_parallel/tiled_layer.py)
            from deepspeed.runtime.sequence_parallel.tiled_layer import enable_tiled_decoder_layers
            enable_tiled_decoder_layers(model, tile_tokens=args.layer_tile)
        # the norms keep only their inputs (runtime/sequence_parallel/recompute.py); inside tiled layers they
        # run in tiles already, so then only the final norm
        if not args.no_recompute_norms:
            enable_recompute_in_backward(model.model.norm if tiled_layers else model)
    else:
        # (no pinned memory without a GPU: the CPU smoke test checkpoints without offload)
        model.gradient_checkpointing_enable(offload=_device(args).type == "cuda")
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {
            "enabled": True
        },
        "zero_optimization": {
            "stage": 3
        },
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-5,
                # explicit: upstream's torch.optim.AdamW would decay by 0.01, this package's FusedAdam by 0
                "weight_decay": 0.0,
                "torch_adam": True
            }
        },
        "gradient_clipping": 1.0,
        "steps_per_print": 1 << 30,
    }
    if impl == "ours":  # this package's FusedAdam; upstream's would be built on first use (torch's: the same step)
        ds_config["optimizer"]["params"].pop("torch_adam")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return engine, model, ulysses


def _step(engine, model, ulysses, seq, logits_tile, vocab):
    import torch
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seq)
    ids = torch.randint(0, vocab, (1, seq), device=device, generator=gen)
    position_ids = torch.arange(seq, device=device).unsqueeze(0)
    shift_labels = torch.full_like(ids, -100)
    shift_labels[:, :-1] = ids[:, 1:]
    hidden = model.model(input_ids=ids, position_ids=position_ids).last_hidden_state
    tokens = seq - 1

    # Each tile's share of the mean over the sample's tokens, so that the tiled loss is the loss itself and its
    # incoming gradient is 1: upstream 0.19.8's TiledFusedLogitsLoss does not scale the head weight's gradient by
    # its incoming gradient (docs/compatibility.md), so a division after it would give upstream's head a gradient
    # `tokens` times too large and, through clipping, a different step.
    def loss_fn(self, x, y):
        logits = self.lm_head(x).float()
        return torch.nn.functional.cross_entropy(
            logits.view(-1, logits.shape[-1]), y.view(-1), ignore_index=-100, reduction="sum") / tokens

    shards = max(1, math.ceil(seq / logits_tile))
    loss = ulysses.TiledFusedLogitsLoss.apply(loss_fn, model, hidden, shift_labels, None, shards,
                                              [model.lm_head.weight], "sum")
    engine.backward(loss)
    engine.step()
    return float(loss)


def _trial(state, args, impl, seq):
    """One step at ``seq`` tokens: ``{seq, ok, seconds, peak_gib, loss | error}``; a fresh engine after an OOM."""
    import torch
    device = _device(args)
    if state.get("engine") is None:
        state["engine"], state["model"], state["ulysses"] = _build(args, impl)
        state["held_gib"] = _hold_missing_layers(state, args)
    _sync(device)
    if device.type == "cuda":
        gc.collect()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:  # pinned blocks cached from shorter steps (same for both implementations)
            empty_host()
        torch.cuda.reset_peak_memory_stats()
        reset_host = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
        if reset_host is not None:
            reset_host()
    record = {"seq": seq}
    try:
        began = time.perf_counter()
        host_hold, host_held = _hold_missing_host(args, impl, seq)
        if host_held:
            record.update(host_held_gib=host_held, host_hold_seconds=time.perf_counter() - began)
    except RuntimeError as exc:  # the other layers' inputs do not fit in pinned host memory
        record.update(ok=False, seconds=0.0, error=f"host: {str(exc).splitlines()[0][:200]}")
        gc.collect()
        getattr(torch._C, "_host_emptyCache", lambda: None)()  # what was pinned before the failure
        print(json.dumps({"impl": impl, **record}), flush=True)
        return record
    start = time.perf_counter()
    tracing = bool(getattr(args, "trace_peak", None)) and device.type == "cuda" and seq == args.compare_at
    if tracing:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        record["loss"] = _step(state["engine"], state["model"], state["ulysses"], seq, args.logits_tile,
                               _shape(args)["vocab_size"])
        _sync(device)
        record.update(ok=True, seconds=time.perf_counter() - start)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not isinstance(exc, torch.OutOfMemoryError) and "out of memory" not in str(exc).lower():
            raise  # (a pinned host allocation that fails says "out of memory" too)
        record.update(ok=False, seconds=time.perf_counter() - start, error=str(exc).split("\n")[0][:200])
        _drop(state)
    record["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    del host_hold
    record["host_peak_gib"] = _host_peak_gib()
    pinned = _pinned_gib()
    if pinned is not None:
        record["pinned_peak_gib"] = pinned[1]
    if state.get("held_gib"):
        record["held_gib"] = state["held_gib"]
    if tracing:
        summary = _trace_summary(torch.cuda.memory._snapshot())
        torch.cuda.memory._record_memory_history(enabled=None)
        with open(f"{args.trace_peak}_{impl}_{seq}.json", "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps({"impl": impl, **record}), flush=True)
    return record


_HELD = {}  # the device bytes held for the missing layers, once measured
_FULL_LAYERS = LLAMA_3_2_1B["num_hidden_layers"]


def _holds(args):
    """Whether this run stands in for the whole model's memory: fewer layers than its 16, on a GPU."""
    return not (args.tiny or not args.layers or args.layers >= _FULL_LAYERS or _device(args).type != "cuda"
                or args.no_hold)


def _hold_missing_layers(state, args):
    """With ``--layers N`` below the model's 16 on a GPU: after a short step (so that the optimizer state exists),
    hold the device memory the other layers' parameters, gradients and optimizer state would take, at the bytes
    per parameter this engine holds between steps (the embeddings' rate: ZeRO-3 keeps every parameter alike).
    Returns the GiB held (0 when nothing is held)."""
    import torch
    if not _holds(args):
        return 0.0
    if _HELD.get("bytes") is not None:  # measured on the first engine of this process: an engine rebuilt after
        #  an OOM would count what the failed one left behind
        state["hold"] = torch.empty(_HELD["bytes"], dtype=torch.uint8, device="cuda")
        return _HELD["bytes"] / 2**30
    _step(state["engine"], state["model"], state["ulysses"], 4096, args.logits_tile, _shape(args)["vocab_size"])
    torch.cuda.synchronize()
    gc.collect()
    persistent = torch.cuda.memory_allocated()

    def numel(p):
        return getattr(p, "ds_numel", p.numel())

    model = state["model"]
    total = sum(numel(p) for p in model.parameters())
    per_layer = sum(numel(p) for p in model.model.layers[0].parameters())
    held = int(persistent / total * per_layer * (_FULL_LAYERS - args.layers))
    state["hold"] = torch.empty(held, dtype=torch.uint8, device="cuda")
    _HELD["bytes"] = held
    return held / 2**30


def _hold_missing_host(args, impl, seq):
    """With ``--layers N`` below 16 on a GPU: the pinned host memory the other layers' offloaded inputs would take
    at ``seq`` tokens, allocated the way each implementation allocates one (upstream, through Transformers'
    ``save_on_cpu``: one pinned tensor per input, which torch's host allocator rounds up to a power of two; this
    package: power-of-two pieces of the input's own size). Returns ``(buffers, GiB)``; raises what a failed
    pinned allocation raises."""
    import torch
    if not _holds(args):
        return [], 0.0
    nbytes = seq * _shape(args)["hidden_size"] * 2  # one layer's bf16 input [1, seq, hidden]
    buffers = []
    for _ in range(_FULL_LAYERS - args.layers):
        if impl == "ours":
            from deepspeed.runtime.sequence_parallel.activation_offload import _host_pieces
            buffers += _host_pieces(nbytes)
        else:
            buffers.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
    return buffers, (_pinned_gib() or (0.0, 0.0))[0]


def _pinned_gib():
    """``(current, peak)`` GiB of pinned host memory in use (torch's caching host allocator), or None."""
    import torch
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    try:
        s = stats()
    except Exception:  # an older torch without the counters
        return None
    current = s.get("allocated_bytes.current", s.get("active_bytes.all.current"))
    peak = s.get("allocated_bytes.peak", s.get("active_bytes.all.peak"))
    return None if current is None else (current / 2**30, (peak or 0) / 2**30)


def _host_peak_gib():
    """The process's peak resident host memory so far (``ru_maxrss``; the offloaded checkpoints live there)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def project(trials, total_gib, key="peak_gib"):
    """The length at which the linear fit ``peak = a + b * seq`` through the two longest successful steps reaches
    ``total_gib``: with flash attention, tiled MLPs, a tiled loss and checkpointed layers every remaining activation
    is linear in the length, so this is where the search would run out of memory if a step there took no time.
    None when fewer than two lengths succeeded or the peak does not grow."""
    ok = {}
    for rec in trials:
        if rec.get("ok") and rec.get(key) is not None:
            ok[rec["seq"]] = max(ok.get(rec["seq"], 0.0), rec[key])
    if len(ok) < 2 or not total_gib:
        return None
    (s0, m0), (s1, m1) = sorted(ok.items())[-2:]
    slope = (m1 - m0) / (s1 - s0)
    if slope <= 0:
        return None
    return {"seq": int(s1 + (total_gib - m1) / slope), "gib_per_1k_tokens": slope * 1024, "total_gib": total_gib}


def _trace_summary(snapshot, top=25):
    """The allocations live at the peak of a recorded step, grouped by the innermost frame outside torch itself:
    ``[{where, gib, count}]`` (what ``--trace-peak`` writes). Only what was allocated while recording counts."""
    events = [e for trace in snapshot.get("device_traces", []) for e in trace]
    live, current, peak, peak_index = {}, 0, 0, -1
    for index, event in enumerate(events):  # first pass: when the peak happens
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            current += event["size"]
            if current > peak:
                peak, peak_index = current, index
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])
    live = {}
    for event in events[:peak_index + 1]:  # second pass: what is live then
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    groups = {}
    for event in live.values():
        where = "?"
        for frame in event.get("frames", []):
            name = frame.get("filename", "")
            if "/torch/" in name and "/torch/utils/checkpoint" not in name:
                continue
            where = f"{name.split('site-packages/')[-1]}:{frame.get('line')} {frame.get('name')}"
            break
        entry = groups.setdefault(where, {"where": where, "gib": 0.0, "count": 0})
        entry["gib"] += event["size"] / 2**30
        entry["count"] += 1
    ranked = sorted(groups.values(), key=lambda g: -g["gib"])[:top]
    return {"peak_recorded_gib": peak / 2**30, "live_at_peak": ranked}


def _drop(state):
    import torch
    engine = state.pop("engine", None)
    state.pop("model", None)
    state.pop("hold", None)
    if engine is not None and hasattr(engine, "destroy"):
        try:
            engine.destroy()
        except Exception:  # an engine broken by the OOM: dropping it is all that is left to do
            pass
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def search(args, impl):
    """The doubling-then-bisecting search of the module docstring, then the throughput step."""
    import deepspeed
    import torch
    state, trials = {}, []
    began = time.perf_counter()

    def out_of_time():
        return time.perf_counter() - began > args.time_budget

    good, bad, seq, capped = 0, None, args.start, False
    last_seconds = None
    for seq in [int(x) for x in args.lengths.split(",") if x]:  # --lengths: exactly these, in order
        rec = _trial(state, args, impl, seq)
        trials.append(rec)
        if rec["ok"]:
            good = max(good, seq)
        elif bad is None or seq < bad:
            bad = seq
    if args.lengths:
        capped = True  # no search: the longest success among the lengths tried
    while bad is None and not args.lengths:
        # a doubled length costs about 4x (attention is quadratic): stop before a step that cannot end in time
        predicted = 4.0 * last_seconds if last_seconds else 0.0
        if out_of_time() or seq > args.cap or time.perf_counter() - began + predicted > args.time_budget:
            capped = True
            break
        rec = _trial(state, args, impl, seq)
        last_seconds = rec["seconds"]
        trials.append(rec)
        if rec["ok"]:
            good, seq = seq, seq * 2
        else:
            bad = seq
    while bad is not None and bad - good > args.resolution and not capped:
        if out_of_time():
            capped = True
            break
        mid = (good + bad) // 2 // args.resolution * args.resolution or args.resolution
        if mid <= good:
            break
        rec = _trial(state, args, impl, mid)
        trials.append(rec)
        if rec["ok"]:
            good = mid
        else:
            bad = mid
    compare = args.compare_at or good
    throughput = None
    if compare and not args.no_throughput:
        _trial(state, args, impl, compare)  # warm-up at this length
        recs = [_trial(state, args, impl, compare) for _ in range(max(1, args.measure_steps))]
        if all(r["ok"] for r in recs):
            seconds = sorted(r["seconds"] for r in recs)
            n = len(seconds)
            median = seconds[n // 2] if n % 2 else (seconds[n // 2 - 1] + seconds[n // 2]) / 2
            throughput = {
                "seq": compare,
                "tokens_per_s": compare / median,  # at the median measured step
                "seconds": median,
                "peak_gib": max((r["peak_gib"] for r in recs if r["peak_gib"] is not None), default=None),
                "steps_seconds": [r["seconds"] for r in recs],  # each measured step, in order
                "tokens_per_s_min": compare / seconds[-1],
                "tokens_per_s_max": compare / seconds[0],
                "losses": [r.get("loss") for r in recs],
            }
    device = _device(args)
    total = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
    host_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "impl": impl,
        "deepspeed": f"{deepspeed.__version__} ({os.path.dirname(deepspeed.__file__)})",
        "projected_device_limit": project(trials, total),
        "projected_host_limit": project(trials, host_total, key="host_peak_gib"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if _device(args).type == "cuda" else "cpu",
        "longest_ok": good,
        "first_oom": bad,
        "capped": capped,
        "throughput": throughput,
        "trials": trials,
    }


# ------------------------------------------------------------------------------------------------ memory probe
def probe_memory(args):
    """Bytes kept between forward and backward by one MLP and by the loss head, untiled and tiled, at ``--start``
    tokens of the model's shape, counted on the meta device (shapes only: nothing is allocated, no GPU needed).

    Kept: every tensor autograd saves for backward (saved-tensor hooks, each storage once); for the tiled loss,
    what it stores for its backward (the input's gradient and the head's weight gradient). The tiled functions'
    transient peak is one tile's intermediates, reported beside (``tile_bytes``).
    """
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP
    from deepspeed.runtime.sequence_parallel.tiled_compute import TiledFusedLogitsLoss, TiledMLP
    shape = _shape(args)
    config = LlamaConfig(**shape)
    seq, hidden, vocab, inner = args.start, shape["hidden_size"], shape["vocab_size"], shape["intermediate_size"]
    dtype = torch.bfloat16

    def kept(fn):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            extra = fn()
        return sum(seen.values()) + extra

    with torch.device("meta"):
        mlp = LlamaMLP(config).to(dtype)
        head = torch.nn.Linear(hidden, vocab, bias=False).to(dtype)
        x = torch.empty(1, seq, hidden, dtype=dtype, requires_grad=True)
        y = torch.zeros(1, seq, dtype=torch.long)

    def mlp_fn(module, h):
        return module.down_proj(module.act_fn(module.gate_proj(h)) * module.up_proj(h))

    def loss_fn(module, h, t):
        return torch.nn.functional.cross_entropy(module(h).float().view(-1, vocab), t.view(-1), reduction="sum")

    mlp_tiles = max(1, math.ceil(seq / hidden))
    loss_tiles = max(1, math.ceil(seq / args.logits_tile))
    rows = {
        "mlp": kept(lambda: (mlp_fn(mlp, x), 0)[1]),
        "tiled_mlp": kept(lambda: (TiledMLP.apply(mlp_fn, mlp, x, mlp_tiles, None), 0)[1]),
        "logits_loss": kept(lambda: (loss_fn(head, x, y), 0)[1]),
        # the tiled loss saves nothing for backward; its per-tile graphs are gone when forward returns
        "tiled_logits_loss": _tiled_loss_kept(TiledFusedLogitsLoss, loss_fn, head, x, y, loss_tiles),
    }
    tile = {
        "tiled_mlp": 3 * math.ceil(seq / mlp_tiles) * inner * 2,
        "tiled_logits_loss": 2 * math.ceil(seq / loss_tiles) * vocab * 4
    }
    result = {"seq": seq, "hidden": hidden, "vocab": vocab, "kept_bytes": rows, "tile_bytes": tile}
    print(json.dumps(result), flush=True)
    return result


def _tiled_loss_kept(fn_class, loss_fn, head, x, y, tiles):
    import torch
    out = fn_class.apply(loss_fn, head, x, y, None, tiles, [head.weight], "sum")
    ctx = out.grad_fn
    stored = [t for t in (getattr(ctx, "x_grad", None), ) if torch.is_tensor(t)]
    stored += [g for g in ctx.param_grads.sums if g is not None]
    return sum(t.numel() * t.element_size() for t in stored)


# ------------------------------------------------------------------------------------------------ the driver
def _child(args, impl, compare_at, out):
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(29500 + os.getpid() % 1000))):
        env.setdefault(key, value)
    if impl == "ours":
        env["PYTHONPATH"] = os.pathsep.join([_REPO_ROOT, env.get("PYTHONPATH", "")])
    else:
        env["PYTHONPATH"] = os.pathsep.join([args.upstream_path, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, os.path.abspath(__file__), "--impl", impl, "--out", out]
    for name in ("start", "cap", "resolution", "time_budget", "logits_tile", "trace_peak", "layers", "layer_tile",
                 "lengths", "measure_steps"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--no-throughput"] if args.no_throughput else []
    cmd += ["--no-recompute-norms"] if args.no_recompute_norms else []
    cmd += ["--no-tiled-layers"] if args.no_tiled_layers else []
    cmd += ["--no-hold"] if args.no_hold else []
    cmd += ["--tied"] if args.tied else []
    cmd += ["--cpu"] if args.cpu else []
    if compare_at:
        cmd += ["--compare-at", str(compare_at)]
    if os.path.exists(out):
        os.remove(out)
    proc = subprocess.run(cmd, env=env, check=False, timeout=args.time_budget * 3 + 300)
    if not os.path.exists(out):
        return {
            "impl": impl,
            "error": f"exit code {proc.returncode}",
            "longest_ok": 0,
            "first_oom": None,
            "capped": False,
            "throughput": None,
            "trials": []
        }
    with open(out) as f:
        return json.load(f)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=["ours", "upstream", "both"], default="both")
    parser.add_argument("--upstream-path", default="/tmp/upstream", help="folder holding upstream's deepspeed")
    parser.add_argument("--start", type=int, default=16384)
    parser.add_argument("--cap", type=int, default=1 << 24, help="longest length tried")
    parser.add_argument("--resolution", type=int, default=8192)
    parser.add_argument("--time-budget", type=float, default=600.0, help="seconds per search")
    parser.add_argument("--logits-tile", type=int, default=8192)
    parser.add_argument("--compare-at", type=int, default=0)
    parser.add_argument("--out", default="sp_bench.json")
    parser.add_argument("--tiny", action="store_true", help="a toy model (smoke test)")
    parser.add_argument("--tied", action="store_true", help="tie the input and output embeddings")
    parser.add_argument("--probe-memory",
                        action="store_true",
                        help="bytes kept for backward, tiled and not "
                        "(meta device; this package's tools)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test)")
    parser.add_argument("--layers",
                        type=int,
                        default=0,
                        help="decoder layers (default: the model's 16). With every layer checkpointed one layer's "
                        "recomputation is live at a time, so a model of fewer layers finds the device-memory limit "
                        "of a length at a fraction of its step time; add the other layers' parameters and "
                        "optimizer state to its peak")
    parser.add_argument("--lengths",
                        default="",
                        help="comma-separated lengths to step, in order, instead of the search (one process)")
    parser.add_argument("--no-hold",
                        action="store_true",
                        help="with --layers: do not hold device memory for the other layers' state nor pinned host "
                        "memory for their offloaded inputs")
    parser.add_argument("--no-tiled-layers",
                        action="store_true",
                        help="this package without enable_tiled_decoder_layers (TiledMLP on the MLPs instead)")
    parser.add_argument("--layer-tile", type=int, default=8192, help="tokens per tile of a tiled decoder layer")
    parser.add_argument("--no-recompute-norms",
                        action="store_true",
                        help="this package without enable_recompute_in_backward on the norms")
    parser.add_argument("--no-throughput", action="store_true", help="skip the throughput steps after the search")
    parser.add_argument("--measure-steps",
                        type=int,
                        default=1,
                        help="measured steps at --compare-at after its warm-up step; tokens/s at their median, with "
                        "each step's seconds and the fastest and slowest step's tokens/s beside")
    parser.add_argument("--trace-peak",
                        default="",
                        help="path prefix: record the steps at --compare-at and write what is live at their peak "
                        "(PREFIX_IMPL_SEQ.json)")
    args = parser.parse_args()
    if args.impl == "ours" and _REPO_ROOT not in sys.path:
        sys.path.insert(0, _REPO_ROOT)  # this package, also when run as --impl ours directly
    if args.probe_memory:
        result = probe_memory(args)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        return
    if args.impl != "both":
        result = search(args, args.impl)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    base = os.path.splitext(args.out)[0]
    upstream = _child(args, "upstream", args.compare_at, base + "_upstream.json")
    compare = args.compare_at or upstream.get("longest_ok") or 0
    ours = _child(args, "ours", compare, base + "_ours.json")
    with open(args.out, "w") as f:
        json.dump({"upstream": upstream, "ours": ours}, f, indent=1)
    for r in (upstream, ours):
        tp = r.get("throughput") or {}
        print(f"{r['impl']:>9}: longest {r['longest_ok']} tokens{' (capped)' if r['capped'] else ''}, first OOM "
              f"{r['first_oom']}; deepspeed {r.get('deepspeed')}; at {tp.get('seq')} tokens: "
              f"{tp.get('tokens_per_s')} tokens/s (median of {len(tp.get('steps_seconds', [])) or '-'} steps, "
              f"{tp.get('tokens_per_s_min')}..{tp.get('tokens_per_s_max')}), peak "
              f"{tp.get('peak_gib')} GiB; projected limits: device {r.get('projected_device_limit')}, host "
              f"{r.get('projected_host_limit')} {r.get('error', '')}")


if __name__ == "__main__":
    main()
