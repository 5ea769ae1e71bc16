# SPDX-License-Identifier: Apache-2.0
"""The random sweep of the offloaded step's paths: one case trained three or four ways in one process, the same bits.

An offload case (:func:`draw_offload`) trains an MLP of random widths with AdamW on the host Adam op, three (with the
disk tier four) times from the same initialisation and data: the whole-partition step (``DS_OFFLOAD_OVERLAP=0``, the
reference of the pipelined paths), the pipelined step (stepped in forward order, uploaded piece by piece, overlapping
the next forward; on ZeRO-3 per gather unit; ``offload_optimizer.ratio`` on ZeRO-3 when drawn), the speculative step
(``super_offload``, pieces stepped in the boundary backward, kept or rolled back), and the pipelined step with the
optimizer state or ZeRO-3's shards on NVMe (``nvme``). Every loss, every 16-bit parameter, fp32 master and Adam
moment must be the same bits after each step. The whole-partition run is also
compared with a plain-torch AdamW over every rank's data (fp32 cases: the same maths, rounded alike up to the
host op's order of operations).

=================  ===========================================================================================
key                meaning
=================  ===========================================================================================
``widths``         the MLP's layer widths (1-wide layers, parameters smaller than the world)
``world``          data-parallel ranks, 1 to 4
``stage``          ZeRO stage 1 to 3
``gas``            gradient accumulation steps, 1 to 3
``dtype``          "fp32", "bf16" or "fp16"
``clip``           ``gradient_clipping`` (0: off; 0.05 clips every step, so a speculative step rolls back)
``bucket``         ``reduce_bucket_size``
``offload_param``  stage 3: ``offload_param`` to the host too
``units``          stage 3: (``stage3_prefetch_bucket_size``, ``stage3_param_persistence_threshold``)
``ratio``          stage 3: ``offload_optimizer.ratio`` of the pipelined run (1.0: full offload)
``delay``          seconds each host piece is slowed by (the ordering exercised)
``call``           how each micro-step calls backward: "engine", "direct" (``loss.backward()``;
                   ``engine.scale(loss).backward()`` under fp16) or "two_losses" (two ``engine.backward``
                   calls over one retained graph: on the boundary micro-step a speculative step sees a second
                   gradient for pieces it may have stepped, and rolls back)
``steps``          optimizer steps
``nvme``           the disk tier of a fourth run, the pipelined step with state on NVMe (a temporary folder;
                   pages of a few elements and a cache of two or three, so every step reads and writes the
                   disk): "optimizer" (masters and moments), "param" (ZeRO-3 shards, with ``offload_param``),
                   "both", or None (world 4). Drawn from a generator of its own, so the other keys of a seed's
                   cases are what they were before the disk tier
=================  ===========================================================================================
"""

import copy
import os
import random
import shutil
import tempfile

import torch

from tests.unit.sweep.run import build_mlp, make_batch, mse

LR, EPS, WD = 1e-2, 1e-4, 0.01
WIDTHS = [1, 1, 2, 3, 5, 7, 8, 13]
DEFAULT_CASES = 8


def draw_offload(rng):
    """One offload case (see the module docstring)."""
    layers = rng.randint(1, 4)
    stage = rng.randint(1, 3)
    case = dict(widths=[rng.choice(WIDTHS) for _ in range(layers + 1)],
                world=rng.choice([1, 1, 2, 2, 3, 4]),
                stage=stage,
                gas=rng.randint(1, 3),
                dtype=rng.choices(["fp32", "bf16", "fp16"], weights=[3, 4, 2])[0],
                clip=rng.choice([0.0, 1.0, 0.05]),
                bucket=rng.choice([1, 5, 16, 64, int(5e8)]),
                offload_param=stage == 3 and rng.random() < 0.5,
                units=(rng.choice([1, 20, int(5e7)]), rng.choice([0, 10, int(1e5)])) if stage == 3 else None,
                ratio=rng.choice([1.0, 1.0, 0.5]) if stage == 3 else 1.0,
                delay=rng.choice([0.0, 0.002]),
                call=rng.choices(["engine", "direct", "two_losses"], weights=[3, 2, 2])[0],
                steps=rng.randint(2, 4))
    return case


def draw_nvme(rng, case):
    """The disk tier of ``case``'s fourth run (see the module docstring)."""
    if case["world"] > 3:
        return None
    if case["stage"] == 3 and case["offload_param"]:
        return rng.choice(["optimizer", "param", "both"])
    return "optimizer"


def offload_cases(seed, count):
    """The ``count`` offload cases of ``seed``: case ``i`` depends on ``(seed, i)`` only."""
    cases = []
    for i in range(count):
        case = draw_offload(random.Random(f"ds-offload-sweep-{seed}-{i}"))
        case["nvme"] = draw_nvme(random.Random(f"ds-offload-sweep-nvme-{seed}-{i}"), case)
        cases.append(case)
    return cases


def offload_case_id(case):
    """A compact name: ``z3-w2-gas2-bf16-5x1x3-b16-clip0.05-offp-u20p10-r0.5-d-s3``."""
    parts = [
        f"z{case['stage']}", f"w{case['world']}", f"gas{case['gas']}", case["dtype"],
        "x".join(str(w) for w in case["widths"]), f"b{case['bucket']}", f"clip{case['clip']:g}"
    ]
    if case["offload_param"]:
        parts.append("offp")
    if case["units"] is not None:
        parts.append(f"u{case['units'][0]}p{case['units'][1]}")
    if case["ratio"] != 1.0:
        parts.append(f"r{case['ratio']:g}")
    if case["delay"]:
        parts.append("d")
    if case.get("call", "engine") != "engine":
        parts.append(case["call"])
    if case.get("nvme"):
        parts.append(f"nvme{case['nvme']}")
    parts.append(f"s{case['steps']}")
    return "-".join(parts)


def _config(case, ratio=1.0, super_offload=False, nvme_path=None):
    offload = {"device": "cpu", "pin_memory": False}
    if ratio != 1.0:
        offload["ratio"] = ratio
    if super_offload:
        offload["super_offload"] = True
    zero = {"stage": case["stage"], "reduce_bucket_size": case["bucket"], "offload_optimizer": offload}
    if case["offload_param"]:
        zero["offload_param"] = {"device": "cpu"}
    if nvme_path is not None:  # a rank's state in about 8 pages, 2 or 3 of them cached: every step uses the disk
        page = max(1, sum(a * b + b for a, b in zip(case["widths"], case["widths"][1:])) // (8 * case["world"]))
        if case["nvme"] in ("optimizer", "both"):
            offload.update(device="nvme", nvme_path=nvme_path, buffer_count=3)
            zero["sub_group_size"] = page
        if case["nvme"] in ("param", "both"):
            zero["offload_param"] = {
                "device": "nvme",
                "nvme_path": nvme_path,
                "buffer_count": 2,
                "buffer_size": page,
                "max_in_cpu": 0
            }
    if case["units"] is not None:
        zero["stage3_prefetch_bucket_size"], zero["stage3_param_persistence_threshold"] = case["units"]
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": case["gas"],
        "gradient_clipping": case["clip"],
        "steps_per_print": float("inf"),
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": LR,
                "eps": EPS,
                "weight_decay": WD
            }
        },
        "zero_optimization": zero,
    }
    if case["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif case["dtype"] == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _train(case, model, overlap, **config):
    """Train a copy of ``model``; per step the losses, the full 16-bit parameters, fp32 masters and moments."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.offload.step_pipeline import StepPipeline
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    rank = dist.get_rank()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case["dtype"]]
    os.environ["DS_OFFLOAD_OVERLAP"] = "1" if overlap else "0"
    os.environ["DS_NATIVE_CPU_ADAM"] = "1"  # an fp32 model on the host op too (the pipelined paths need it)
    StepPipeline.piece_delay = case["delay"] if overlap else 0.0
    engine = None
    try:
        engine = deepspeed.initialize(model=copy.deepcopy(model), config=_config(case, **config))[0]
        if overlap:
            assert engine._stage.host_step.pipeline is not None, "the offloaded step is not pipelined"
        tiers = [
            t for t in (engine._stage.host_step.swap, getattr(engine._stage, "param_tier", None)) if t is not None
        ]
        assert len(tiers) == {
            None: 0,
            "optimizer": 1,
            "param": 1,
            "both": 2
        }[case["nvme"] if "nvme_path" in config else None], tiers
        widths, gas = case["widths"], case["gas"]
        trace = []
        for step in range(case["steps"]):
            losses = []
            for micro in range(gas):
                x, y = make_batch(widths, rank, step * gas + micro, dtype=dtype)
                out = engine(x)
                loss = mse(out, y)
                call = case.get("call", "engine")
                if call == "engine":
                    engine.backward(loss)
                elif call == "direct":
                    (engine.scale(loss) if case["dtype"] == "fp16" else loss).backward()
                else:
                    engine.backward(loss, retain_graph=True)
                    engine.backward(_second_loss(out))
                engine.step()
                losses.append(loss.item())
            names = [n for n, _ in engine.module.named_parameters()]
            params = dict(engine.module.named_parameters())
            # the values as a reader sees them: state_dict() completes a step still running (a direct read of a
            # parameter between step() and the next forward does not, docs/offload.md); ZeRO-3 gathers them
            with deepspeed.zero.GatheredParameters(list(params.values())):
                state = engine.module.state_dict()
                values = {n: state[n].detach().clone() for n in names}
            masters = {n: safe_get_full_fp32_param(params[n]).clone() for n in names}
            moments = {
                (n, k): safe_get_full_optimizer_state(params[n], k).clone()
                for n in names
                for k in ("exp_avg", "exp_avg_sq")
            }
            trace.append(dict(losses=losses, values=values, masters=masters, moments=moments))
        for tier in tiers:  # the disk was written, and read where the cache cannot hold every page
            stats = tier.store.stats
            assert stats["writes"] > 0 and (stats["reads"] > 0 or len(tier.table.pages) <= tier.store.slots), stats
        stats = engine.optimizer.speculative_stats
        return trace, stats
    finally:
        StepPipeline.piece_delay = 0.0
        os.environ.pop("DS_OFFLOAD_OVERLAP", None)
        os.environ.pop("DS_NATIVE_CPU_ADAM", None)
        if engine is not None:
            engine.destroy()


def _second_loss(out):
    """The second loss of the "two_losses" call, over the first one's retained graph."""
    return out.float().pow(2).mean() * 0.5


def _torch_reference(case, model, world):
    """Plain torch: AdamW on the mean gradient of every rank's micro-batches (the sum over the window of the
    micro-batch means, divided by ``gas * world``), clipped by the global norm; the parameters after each step."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    widths, gas, out = case["widths"], case["gas"], []
    for step in range(case["steps"]):
        opt.zero_grad()
        for micro in range(gas):
            for r in range(world):
                x, y = make_batch(widths, r, step * gas + micro)
                pred = model(x)
                loss = mse(pred, y)
                if case.get("call", "engine") == "two_losses":
                    loss = loss + _second_loss(pred)
                (loss / (gas * world)).backward()
        if case["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def run_offload_paths(case):
    """The worker body: the three runs, compared bit for bit; fp32 cases also against plain torch. Returns the
    speculative run's counters."""
    import deepspeed.comm as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == case["world"], (world, case["world"])
    torch.manual_seed(0)
    model = build_mlp(case["widths"])
    whole, _ = _train(case, model, overlap=False)
    pipelined, _ = _train(case, model, overlap=True, ratio=case["ratio"])
    runs = {"pipelined": pipelined}
    if case["ratio"] == 1.0:  # super_offload does not take stage-3 partial offload
        runs["speculative"], stats = _train(case, model, overlap=True, super_offload=True)
    else:
        stats = None
    if case.get("nvme"):
        folder = tempfile.mkdtemp(prefix="ds_sweep_nvme_")
        try:
            runs["nvme"], _ = _train(case, model, overlap=True, nvme_path=folder)
            left = [f for _, _, files in os.walk(folder) for f in files if f.endswith(".tensor.swp")]
            assert not left, f"swap files left after destroy(): {left}"
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    for label, trace in runs.items():
        for step, (got, want) in enumerate(zip(trace, whole)):
            where = f"rank {rank} {label} step {step}"
            assert got["losses"] == want["losses"], f"{where}: losses {got['losses']} != {want['losses']}"
            for key in ("values", "masters", "moments"):
                for name, tensor in want[key].items():
                    assert torch.equal(got[key][name], tensor), f"{where}: {key} {name} differ"
    if case["dtype"] == "fp32":
        for step, want in enumerate(_torch_reference(case, model, world)):
            for name, tensor in want.items():
                torch.testing.assert_close(whole[step]["masters"][name],
                                           tensor,
                                           rtol=1e-4,
                                           atol=1e-5,
                                           msg=lambda m: f"rank {rank} step {step} {name} vs torch: {m}")
    return stats
