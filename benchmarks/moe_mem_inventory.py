# SPDX-License-Identifier: Apache-2.0
"""Where the memory of one AutoEP training step goes, on CPU: the model of ``benchmarks/moe_bench.py``.

Runs one side (this package, or upstream DeepSpeed: whichever ``deepspeed`` the Python path imports) with the
benchmark's model and config on CPU (gloo, world 1) and prints:

* the persistent tensors after ``initialize`` and after two steps, deduplicated by storage and grouped by dtype
  and by the attribute path that holds them (parameters, ZeRO partitions, gradient buffers, masters, moments);
* per phase of a step (forward, backward, step) the peak of live storages, followed op by op through a dispatch
  mode (in-place ``UntypedStorage.resize_``, ZeRO-3's way to free a gathered unit, included), with the storages
  live at that peak;
* the bytes each sparse MoE block saves for backward (``saved_tensors_hooks``; parameters left out).

``python benchmarks/moe_mem_inventory.py --system ours --layers 3 --seq 2048 --grouped-mm`` (this package; about
2 minutes on 2 cores, 5 GB of memory); ``cd /tmp && PYTHONPATH=<upstream> python <repo>/benchmarks/
moe_mem_inventory.py --system upstream_autoep ...`` (upstream). ``--grouped-mm`` runs this package's CUDA expert
path (``grouped_mm``) on CPU, so that the saved tensors are the GPU run's. ``--out`` writes the figures as JSON.
docs/moe.md ("Memory against upstream's AutoEP") holds the results.
"""
import argparse
import collections
import gc
import json
import os
import re
import sys
import warnings
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # moe_bench, beside this file

MiB = 2**20


def skey(t):
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def all_tensors():
    out = []
    warnings.filterwarnings("ignore")  # gc holds objects whose isinstance check warns (deprecated modules)
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and not o.is_meta:
                out.append(o)
        except Exception:
            pass
    return out


def walk(obj, path, labels, seen, depth=0):
    """Label every tensor reachable from ``obj`` (attributes, dicts, lists) with its first path."""
    if depth > 7 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.untyped_storage().nbytes() > 0:
            labels.setdefault(obj.untyped_storage().data_ptr(), path)
        for attr in ("ds_tensor", "grad", "_hp_mapping"):
            sub = getattr(obj, attr, None)
            if isinstance(sub, torch.Tensor):
                walk(sub, path + "." + attr, labels, seen, depth + 1)
        return
    if isinstance(obj, (str, bytes, int, float, bool, type(None), torch.device, torch.dtype)):
        return
    if isinstance(obj, torch.nn.Module):
        return
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            walk(v, f"{path}[{str(k)[:30]}]", labels, seen, depth + 1)
            if isinstance(k, torch.Tensor):
                walk(k, f"{path}<key>", labels, seen, depth + 1)
        return
    if isinstance(obj, (list, tuple, set, collections.deque)):
        for i, v in enumerate(list(obj)):
            walk(v, f"{path}[{i}]" if i < 3 else f"{path}[*]", labels, seen, depth + 1)
        return
    d = getattr(obj, "__dict__", None)
    if d is not None and type(obj).__module__.split(".")[0] in ("deepspeed", "torch"):
        walk(d, path + ":" + type(obj).__name__, labels, seen, depth + 1)


def generic(path):
    """Collapse indices so that a path names a category."""
    return re.sub(r"\[\d+\]|\[\*\]", "[i]", path)


def inventory(engine, model, tag):
    gc.collect()
    labels = {}
    for name, p in model.named_parameters():
        if p.untyped_storage().nbytes() > 0:
            labels.setdefault(p.untyped_storage().data_ptr(), "model.param")
        ds = getattr(p, "ds_tensor", None)
        if ds is not None:
            labels.setdefault(ds.untyped_storage().data_ptr(), "model.param.ds_tensor")
        if p.grad is not None:
            labels.setdefault(p.grad.untyped_storage().data_ptr(), "model.param.grad")
    for name, b in model.named_buffers():
        labels.setdefault(b.untyped_storage().data_ptr(), "model.buffer")
    walk(engine.optimizer, "opt", labels, set())
    walk({k: v for k, v in engine.__dict__.items() if k not in ("module", "optimizer")}, "engine", labels, set())
    rows = collections.defaultdict(lambda: [0, 0])
    seen = set()
    for t in all_tensors():
        if t.device.type != "cpu":
            continue
        st = t.untyped_storage()
        k = st.data_ptr()
        if st.nbytes() == 0 or k in seen:
            continue
        seen.add(k)
        label = generic(labels.get(k, "unlabelled:" + str(tuple(t.shape))[:40]))
        key = (label, str(t.dtype).replace("torch.", ""))
        rows[key][0] += st.nbytes()
        rows[key][1] += 1
    total = sum(v[0] for v in rows.values())
    print(f"== {tag}: persistent {total / MiB:.1f} MiB")
    for (label, dt), (n, c) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        if n >= MiB / 4:
            print(f"   {n / MiB:10.1f} MiB {c:5d} {dt:9s} {label}")
    return total, {f"{k[0]}|{k[1]}": v[0] for k, v in rows.items()}


class LiveMem(TorchDispatchMode):
    """Live bytes of every storage an op returns (plus the ones registered), freed when the storage dies;
    in-place storage resizes (``UntypedStorage.resize_``, ZeRO-3's way to free a gathered unit) are followed."""

    active = None

    def __init__(self):
        super().__init__()
        self.live = {}  # StorageImpl pointer -> [nbytes, dtype, shape, phase, weakref]
        self.cur = 0
        self.peak = 0
        self.phase = "?"
        self.peak_phase = None
        self.by_dtype = collections.Counter()
        self.peak_by_dtype = None
        self.snap = None
        self.snap_at = 0
        self.phase_peak, self.phase_snap, self.phase_snap_at = {}, {}, {}

    def _free(self, k, ref):
        e = self.live.get(k)
        if e is not None and e[4] is ref:
            del self.live[k]
            self.cur -= e[0]
            self.by_dtype[e[1]] -= e[0]

    def _bump(self):
        ph = self.phase
        if self.cur > self.phase_peak.get(ph, -1):
            self.phase_peak[ph] = self.cur
            if self.cur - self.phase_snap_at.get(ph, 0) > MiB and ph not in ("pre", "?"):
                self.phase_snap[ph] = [tuple(e[:4]) for e in self.live.values() if e[0] > 0]
                self.phase_snap_at[ph] = self.cur
        if self.cur > self.peak:
            self.peak = self.cur
            self.peak_phase = self.phase
            self.peak_by_dtype = dict(self.by_dtype)
            if self.peak - self.snap_at > MiB and self.phase not in ("pre", "?"):
                self.snap = [tuple(e[:4]) for e in self.live.values() if e[0] > 0]
                self.snap_at = self.peak

    def resized(self, st):
        e = self.live.get(st._cdata)
        if e is not None:
            n = st.nbytes()
            self.cur += n - e[0]
            self.by_dtype[e[1]] += n - e[0]
            e[0] = n
            self._bump()

    def register(self, t):
        if t.device.type != "cpu":
            return
        st = t.untyped_storage()
        k = st._cdata
        if k in self.live:
            if self.live[k][0] != st.nbytes():
                self.resized(st)
            return
        n = st.nbytes()
        dt = str(t.dtype).replace("torch.", "")
        holder = []
        ref = weakref.ref(st, lambda r, k=k, h=holder: self._free(k, h[0]))
        holder.append(ref)
        self.live[k] = [n, dt, tuple(t.shape), self.phase, ref]
        self.cur += n
        self.by_dtype[dt] += n
        self._bump()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.register(t)
        return out


_orig_resize = torch.UntypedStorage.resize_


def _resize(self, size):
    r = _orig_resize(self, size)
    if LiveMem.active is not None:
        LiveMem.active.resized(self)
    return r


torch.UntypedStorage.resize_ = _resize


def saved_bytes(model, block_name, param_ptrs):
    """Bytes a forward of each sparse block saves for backward (unique storages, parameters excluded)."""
    stats = collections.defaultdict(dict)

    def wrap(name, block):
        fwd = block.forward

        def forward(*a, **k):
            rec = stats[name]

            def pack(t):
                st = t.untyped_storage()
                live = {p.untyped_storage().data_ptr() for p in model.parameters()}
                if st.data_ptr() not in param_ptrs and st.data_ptr() not in live and st.nbytes() > 0:
                    rec[st.data_ptr()] = (st.nbytes(), str(t.dtype).replace("torch.", ""), tuple(t.shape))
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return fwd(*a, **k)

        block.forward = forward

    for name, m in model.named_modules():
        if type(m).__name__ == block_name or type(m).__name__ in ("AutoEPMoELayer", ):
            wrap(name, m)
    return stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", required=True, choices=["ours", "upstream_autoep"])
    ap.add_argument("--model", default="deepseek_v3")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--grouped-mm", action="store_true", help="this package's CUDA expert path on CPU")
    ap.add_argument("--out")
    a = ap.parse_args()
    import moe_bench
    args = argparse.Namespace(system=a.system,
                              model=a.model,
                              layers=a.layers,
                              d_model=1024,
                              experts=64,
                              expert_width=512,
                              top_k=8,
                              seq=a.seq,
                              vocab=32768,
                              tiny=False,
                              hf_experts=None,
                              upstream_autoep_stage=3,
                              device="cpu")
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29633", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
        os.environ.setdefault(k, v)
    import deepspeed
    print("deepspeed", deepspeed.__file__, deepspeed.__version__)
    if a.grouped_mm and a.system == "ours":
        import torch.nn.functional as F
        from deepspeed.moe.autoep import GroupedExperts

        def _grouped(self, x, counts_device):  # the CUDA path of this package, on CPU
            offs = torch.cumsum(counts_device, 0).to(torch.int32)
            gate_up = F.grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offs)
            gate, up = gate_up.chunk(2, dim=-1)
            return F.grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)

        GroupedExperts._grouped = _grouped
    model = moe_bench.build_model(args, torch.bfloat16, "cpu")
    cfg = moe_bench.ds_config(args)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    res = {"system": a.system, "deepspeed": deepspeed.__file__}
    res["init_total"], res["init"] = inventory(engine, model, "after initialize")
    param_ptrs = set()
    for p in model.parameters():
        param_ptrs.add(p.untyped_storage().data_ptr())
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        ids = torch.randint(0, args.vocab, (1, args.seq), generator=gen)
        mode = LiveMem()
        LiveMem.active = mode
        gc.collect()
        for t in all_tensors():
            mode.register(t)
        base = mode.cur
        mode.phase = "pre"
        stats = saved_bytes(engine.module, moe_bench.BLOCKS[args.model], param_ptrs) if step == 1 else None
        with mode:
            mode.phase = "forward"
            loss = engine(input_ids=ids, labels=ids).loss
            mode.phase = "backward"
            engine.backward(loss)
            mode.phase = "step"
            engine.step()
        print(f"step {step}: loss {loss.item():.4f} base {base / MiB:.1f} MiB peak {mode.peak / MiB:.1f} MiB "
              f"(+{(mode.peak - base) / MiB:.1f}) in {mode.peak_phase}; at peak by dtype "
              f"{ {k: round(v / MiB, 1) for k, v in mode.peak_by_dtype.items()} }")
        for phase in ("forward", "backward", "step"):
            agg = collections.Counter()
            for n, dt, shape, ph in mode.phase_snap.get(phase, []):
                if ph != "pre":
                    agg[(dt, shape, ph)] += n
            print(f"  phase {phase}: peak {mode.phase_peak.get(phase, 0) / MiB:.1f} MiB "
                  f"(+{(mode.phase_peak.get(phase, 0) - base) / MiB:.1f}); live storages not from before the step "
                  f"(? = held before, regrown): {sum(agg.values()) / MiB:.1f} MiB")
            for (dt, shape, ph), n in agg.most_common(22):
                print(f"      {n / MiB:8.2f} {dt} {shape} allocated in {ph}")
        res[f"step{step}"] = dict(base=base,
                                  peak=mode.peak,
                                  phase_peak=mode.phase_peak,
                                  phase=mode.peak_phase,
                                  by_dtype=mode.peak_by_dtype)
        if stats:
            for name, rec in stats.items():
                tot = sum(v[0] for v in rec.values())
                by = collections.Counter()
                for n, dt, shape in rec.values():
                    by[dt] += n
                print(f"  saved by {name}: {tot / MiB:.1f} MiB {dict((k, round(v / MiB, 1)) for k, v in by.items())}")
                for n, dt, shape in sorted(rec.values(), reverse=True)[:14]:
                    print(f"      {n / MiB:8.2f} {dt} {shape}")
            res["saved"] = {n: sum(v[0] for v in r.values()) for n, r in stats.items()}
            for name, m in engine.module.named_modules():
                if "forward" in m.__dict__:
                    del m.forward
    res["after_total"], res["after"] = inventory(engine, model, "after two steps")
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
