# SPDX-License-Identifier: Apache-2.0
"""NVMe offload on every path of the offloaded step, against CPU offload of the same configuration, bit for bit.

Each cell trains a small MLP (odd widths, a 1-wide layer) twice from the same initialisation and data on 2 ranks:
once with ``offload_optimizer`` (and, on ZeRO-3, ``offload_param``) on ``device: cpu``, once with the same sections on
``device: nvme`` and the host caches small (``sub_group_size``/``buffer_size`` of a few elements, ``buffer_count`` 2-3,
``max_in_cpu: 0``), so the state must go through the disk. While training, swap files exist under ``nvme_path`` and
the tiers read and write pages; after every step the losses, every 16-bit parameter, fp32 master and every
per-element optimizer state tensor must be the same bits as CPU offload's. Cells cross the optimizer
(``DeepSpeedCPUAdam``, torch's Adam/AdamW through ``torch_adam``, Lion, Adagrad, a client ``torch.optim.SGD`` with
momentum), the dtype (fp32, bf16, fp16), ``overlap_comm``, the pipelined step (``DS_OFFLOAD_OVERLAP``), the stage
and the tiers; a named set plus a seeded random draw of the rest. An optimizer whose update is not elementwise is
refused on every rank (``test_not_elementwise_refused``).
"""

import os
import random
import shutil
import tempfile

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.sweep.run import build_mlp, make_batch, mse

WIDTHS = [17, 48, 1, 24]  # about 480 elements a rank: 8 pages of the optimizer tier's 64-element grid, 3 cached
STATE_KEYS = {
    "cpuadam": ("exp_avg", "exp_avg_sq"),
    "torch_adam": ("exp_avg", "exp_avg_sq"),
    "torch_adamw": ("exp_avg", "exp_avg_sq"),
    "lion": ("exp_avg", ),
    "adagrad": ("exp_avg_sq", ),
    "client_sgd": ("momentum_buffer", ),
}
OPTIMIZERS = list(STATE_KEYS)
DTYPES = ("fp32", "bf16", "fp16")


def _optimizer_section(name):
    params = {"lr": 1e-2, "weight_decay": 0.01}
    if name == "cpuadam":
        return {"type": "AdamW", "params": params}
    if name in ("torch_adam", "torch_adamw"):
        return {"type": "Adam" if name == "torch_adam" else "AdamW", "params": dict(params, torch_adam=True)}
    if name == "lion":
        return {"type": "Lion", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    if name == "adagrad":
        return {"type": "Adagrad", "params": {"lr": 1e-2}}
    return None


def _config(cell, folder):
    stage, dtype = cell["stage"], cell["dtype"]
    device = "nvme" if folder else "cpu"
    zero = {"stage": stage, "reduce_bucket_size": 16, "overlap_comm": cell["overlap_comm"]}
    zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if cell["tiers"] in ("optimizer", "both", "optimizer_only"):
        zero["offload_optimizer"]["device"] = device
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=20, stage3_param_persistence_threshold=3)
    if stage == 3 and cell["tiers"] != "optimizer_only":  # "optimizer_only": the 16-bit shards on the device
        zero["offload_param"] = {"device": "cpu"}
        if cell["tiers"] in ("param", "both"):
            zero["offload_param"]["device"] = device
    if folder:
        zero["sub_group_size"] = 9
        if zero["offload_optimizer"]["device"] == "nvme":
            zero["offload_optimizer"].update(nvme_path=os.path.join(folder, "optimizer"), buffer_count=3)
        if "nvme" == zero.get("offload_param", {}).get("device"):
            zero["offload_param"].update(nvme_path=os.path.join(folder, "param"),
                                         buffer_count=2,
                                         buffer_size=7,
                                         max_in_cpu=0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "steps_per_print": float("inf"),
        "zero_optimization": zero,
    }
    section = _optimizer_section(cell["optimizer"])
    if section is not None:
        cfg["optimizer"] = section
    else:
        cfg["zero_force_ds_cpu_optimizer"] = False
    if cell.get("accum"):  # a 16-bit gradient window: the step is the whole-partition one
        cfg["data_types"] = {"grad_accum_dtype": cell["accum"]}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _swap_files(folder):
    return [f for _, _, files in os.walk(folder) for f in files if f.endswith(".tensor.swp")]


def _train(cell, folder, steps=2):
    """Train one engine; per step the losses, 16-bit parameters, fp32 masters and optimizer state."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    rank = dist.get_rank()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cell["dtype"]]
    torch.manual_seed(0)
    model = build_mlp(WIDTHS)
    client = None
    if cell["optimizer"] == "client_sgd":
        client = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.01)
    engine = deepspeed.initialize(model=model, optimizer=client, config=_config(cell, folder))[0]
    try:
        stage = engine._stage
        tiers = [t for t in (stage.host_step.swap, getattr(stage, "param_tier", None)) if t is not None]
        if folder:
            want = {"optimizer": 1, "optimizer_only": 1, "param": 1, "both": 2}[cell["tiers"]]
            assert len(tiers) == want, f"rank {rank}: {len(tiers)} disk tiers, expected {want}"
        trace = []
        names = [n for n, _ in engine.module.named_parameters()]
        params = dict(engine.module.named_parameters())
        for step in range(steps):
            losses = []
            for micro in range(2):
                x, y = make_batch(WIDTHS, rank, step * 2 + micro, dtype=dtype)
                loss = mse(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            if folder:  # the state is on disk while training (files exist, pages written and read back)
                assert _swap_files(folder), f"rank {rank}: no swap file under {folder} after step {step}"
            with deepspeed.zero.GatheredParameters(list(params.values())):
                state = engine.module.state_dict()
                values = {n: state[n].detach().clone() for n in names}
            masters = {n: safe_get_full_fp32_param(params[n]).clone() for n in names}
            moments = {
                (n, k): safe_get_full_optimizer_state(params[n], k).clone()
                for n in names
                for k in STATE_KEYS[cell["optimizer"]]
            }
            trace.append(dict(losses=losses, values=values, masters=masters, moments=moments))
        for tier in tiers:
            stats = tier.store.stats
            assert stats["writes"] > 0 and stats["reads"] > 0, f"rank {rank}: {type(tier).__name__} {stats}"
        return trace
    finally:
        engine.destroy()


def _run_cells(cells):
    """The worker body: each cell trained on CPU offload and on NVMe, compared bit for bit."""
    import deepspeed.comm as dist
    rank = dist.get_rank()
    for cell in cells:
        saved = os.environ.get("DS_OFFLOAD_OVERLAP")
        os.environ["DS_OFFLOAD_OVERLAP"] = "1" if cell["pipelined"] else "0"
        folder = tempfile.mkdtemp(prefix=f"ds_disk_paths_{rank}_")
        try:
            for sub in ("optimizer", "param"):
                os.makedirs(os.path.join(folder, sub))
            want = _train(cell, None)
            got = _train(cell, folder)
            assert not _swap_files(folder), f"rank {rank}: swap files left after destroy()"
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            if saved is None:
                os.environ.pop("DS_OFFLOAD_OVERLAP", None)
            else:
                os.environ["DS_OFFLOAD_OVERLAP"] = saved
        for step, (a, b) in enumerate(zip(got, want)):
            where = f"rank {rank} {cell_id(cell)} step {step}"
            assert a["losses"] == b["losses"], f"{where}: losses {a['losses']} != {b['losses']}"
            for key in ("values", "masters", "moments"):
                for name, tensor in b[key].items():
                    assert torch.equal(a[key][name], tensor), f"{where}: {key} {name} differ"


def cell_id(cell):
    return (f"z{cell['stage']}-{cell['optimizer']}-{cell['dtype']}-{cell['tiers']}"
            f"{'-oc' if cell['overlap_comm'] else ''}{'-pipe' if cell['pipelined'] else '-whole'}"
            f"{'-accum' + cell['accum'] if cell.get('accum') else ''}")


def _cell(stage, optimizer, dtype, tiers="optimizer", overlap_comm=False, pipelined=True, accum=None):
    cell = dict(stage=stage,
                optimizer=optimizer,
                dtype=dtype,
                tiers=tiers,
                overlap_comm=overlap_comm,
                pipelined=pipelined)
    if accum is not None:
        cell["accum"] = accum
    return cell


# Named cells: every optimizer, every dtype, both overlap settings, ZeRO 1-3 and each tier; the cases (ZeRO-3
# both tiers with torch_adam; an fp32 model; ZeRO-2 with torch_adam).
NAMED = [
    _cell(3, "torch_adamw", "bf16", "both", overlap_comm=True),
    _cell(3, "cpuadam", "fp32", "both"),
    _cell(2, "torch_adam", "bf16", overlap_comm=True),
    _cell(1, "lion", "fp16"),
    _cell(2, "adagrad", "fp32", pipelined=False),
    _cell(3, "client_sgd", "bf16", "param"),
    _cell(1, "cpuadam", "bf16", pipelined=False, overlap_comm=True),
    _cell(2, "cpuadam", "bf16", "optimizer", accum="bf16"),
    _cell(3, "lion", "fp32", "optimizer_only", pipelined=False),
]


def _drawn(count, seed=35):
    rng = random.Random(seed)
    cells = []
    while len(cells) < count:
        stage = rng.randint(1, 3)
        cell = _cell(stage, rng.choice(OPTIMIZERS), rng.choice(DTYPES),
                     rng.choice(["optimizer", "optimizer_only", "param", "both"]) if stage == 3 else "optimizer",
                     rng.random() < 0.5,
                     rng.random() < 0.5)
        if cell not in NAMED and cell not in cells:
            cells.append(cell)
    return cells


DRAWN = _drawn(int(os.environ.get("DS_DISK_PATH_CASES", 2)))


@pytest.mark.parametrize("chunk", [NAMED[:5], NAMED[5:], DRAWN], ids=["named-a", "named-b", "drawn"])
def test_nvme_matches_cpu_offload(chunk):
    run_distributed(_run_cells, 2, args=(chunk, ), timeout=300)


class _TrustRatioSGD(torch.optim.Optimizer):
    """SGD scaled by the norm of the whole parameter (a LAMB-like trust ratio): not elementwise."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * float(p.norm()) / (1.0 + float(p.grad.norm())))


def _refused(stage, folder):
    import deepspeed
    import deepspeed.comm as dist
    rank = dist.get_rank()
    model = build_mlp(WIDTHS)
    zero = {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": folder}, "sub_group_size": 9}
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero, "zero_force_ds_cpu_optimizer": False}
    try:
        deepspeed.initialize(model=model, optimizer=_TrustRatioSGD(model.parameters()), config=cfg)
    except NotImplementedError as error:
        text = str(error)
        for part in ("zero_optimization.offload_optimizer.device", "'cpu'", "_TrustRatioSGD", "not elementwise"):
            assert part in text, f"rank {rank}: {part!r} not in {text}"
        return text
    raise AssertionError(f"rank {rank}: a non-elementwise optimizer was accepted with NVMe offload")


@pytest.mark.parametrize("stage", [1, 3])
def test_not_elementwise_refused(stage, tmp_path):
    texts = run_distributed(_refused, 2, args=(stage, str(tmp_path)), timeout=120)
    assert texts[0] == texts[1]


def test_probe_fields():
    """The probe finds each optimizer's per-element state and accepts torch's fused Adam on aligned ranges."""
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.lion import DeepSpeedCPULion
    from deepspeed.runtime.swap_tensor.paged_step import probe_state_fields
    p = [torch.nn.Parameter(torch.zeros(3))]
    cases = [(torch.optim.AdamW(p, fused=True), {"exp_avg", "exp_avg_sq"}),
             (torch.optim.Adam(p, amsgrad=True), {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
             (DeepSpeedCPULion(p), {"exp_avg"}), (DeepSpeedCPUAdagrad(p), {"exp_avg_sq"}),
             (torch.optim.SGD(p, lr=0.1), set()), (torch.optim.SGD(p, lr=0.1, momentum=0.5), {"momentum_buffer"})]
    for optimizer, want in cases:
        assert set(probe_state_fields(optimizer, torch.float32, False)) == want, type(optimizer).__name__
        assert not optimizer.state, "the probe left state behind"


def _resume(cell, root):
    """Train 4 steps on NVMe saving after 2; a new engine (its own swap folder) loads and trains steps 3-4: the same
    losses (the paged step's state round-trips through a checkpoint)."""
    import deepspeed
    os.environ["DS_OFFLOAD_OVERLAP"] = "1" if cell["pipelined"] else "0"

    def run(folder, load):
        for sub in ("optimizer", "param"):
            os.makedirs(os.path.join(folder, sub), exist_ok=True)
        torch.manual_seed(0)
        engine = deepspeed.initialize(model=build_mlp(WIDTHS), config=_config(cell, folder))[0]
        losses = []
        try:
            if load:
                engine.load_checkpoint(os.path.join(root, "ckpt"))
            for micro in range(4 if load else 0, 8):
                x, y = make_batch(WIDTHS, 0, micro, dtype=torch.bfloat16)
                loss = mse(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                if micro == 3 and not load:
                    engine.save_checkpoint(os.path.join(root, "ckpt"))
        finally:
            engine.destroy()
        return losses

    full = run(os.path.join(root, "a"), False)
    resumed = run(os.path.join(root, "b"), True)
    assert full[4:] == resumed, (full, resumed)


def test_checkpoint_resumes_exactly(tmp_path):
    run_distributed(_resume, 1, args=(_cell(3, "lion", "bf16", "both", pipelined=False), str(tmp_path)), timeout=120)
