# SPDX-License-Identifier: Apache-2.0
"""The training systems the benchmark compares, each behind the same three calls.

``make_system(name, model, hp, device)`` wraps a freshly built fp32 ``GPT`` (on ``device``) and returns an object
with ``step(micro_batches) -> loss`` (one optimizer step over the GAS micro-batches; the returned loss is this
rank's mean over them, a detached tensor, not synchronised) and ``close()`` (drop hooks and references so the
memory can be freed). ``hp`` holds ``micro_batch``, ``gas``, ``lr``, ``weight_decay``, ``betas``, ``clip`` and
``bucket_size``.

* ``ds_zero0/1/2/3``: this package (or, run with ``DS_BENCH_UPSTREAM=1``, whichever ``deepspeed`` comes first on
  the path), ``deepspeed.initialize`` with a bf16 ZeRO config; ``engine.backward`` divides by GAS and
  ``engine.step`` steps at the boundary. Modifiers after the name: ``+offload`` puts the optimizer on the host
  (``offload_optimizer: {device: cpu}``, and on stage 3 the parameters too: ``offload_param``), ``+zenflow``
  adds a ``zenflow`` section to that (``hp["zenflow"]``); ``hp["pin_memory"]`` sets both sections' ``pin_memory``.
  ``+nvme`` puts the optimizer state (and on stage 3 the parameters) on NVMe instead: ``device: nvme`` with
  ``nvme_path`` ``hp["nvme_path"]``, the page and buffer sizes of :data:`NVME_SECTIONS` (the same keys mean the same
  to upstream's ZeRO-Infinity; ``--ds-extra`` overrides them).
* ``fsdp2``: ``fully_shard`` on every block and on the root, bf16 compute with fp32 gradient reduction, fp32
  sharded parameters; the loss is divided by GAS by hand and gradients are reduced every micro-step (the default).
* ``ddp``: fp32 parameters under ``torch.autocast(bfloat16)``, ``no_sync`` on every micro-step but the last.

All use AdamW (fused kernels where the device has them) and gradient clipping by global norm.
"""

import contextlib

import torch

from benchmarks.gpt import lm_loss

SYSTEMS = ("ds_zero0", "ds_zero1", "ds_zero2", "ds_zero3", "fsdp2", "ddp")
MODIFIERS = ("offload", "zenflow", "nvme", "deepcompile")

# What ``+nvme`` adds, besides ``device`` and ``nvme_path``: upstream needs ``buffer_size`` to hold the largest
# parameter (the reference model's tied embedding: 50304 x 2048 = 1.03e8 elements) and ``sub_group_size`` well
# under its default (it pins ``buffer_count x sub_group_size`` fp32 elements for the optimizer swap).
NVME_SECTIONS = {
    "sub_group_size": int(1e8),
    "offload_optimizer": {
        "buffer_count": 4,
        "pipeline_read": False,
        "pipeline_write": False
    },
    "offload_param": {
        "buffer_count": 5,
        "buffer_size": int(2e8),
        "max_in_cpu": int(1e9)
    },
    "aio": {
        "block_size": 1048576,
        "queue_depth": 32,
        "intra_op_parallelism": 2,
        "single_submit": False,
        "overlap_events": True
    },
}


def split_name(name):
    """``"ds_zero2+offload"`` -> ``("ds_zero2", ("offload",))``; ValueError for an unknown system or modifier."""
    base, *mods = name.split("+")
    if base not in SYSTEMS:
        raise ValueError(f"unknown system {base!r}; choose from {', '.join(SYSTEMS)}")
    for mod in mods:
        if mod not in MODIFIERS or not base.startswith("ds_zero"):
            raise ValueError(f"unknown modifier {mod!r} of {base!r}: ds_zero* systems take {', '.join(MODIFIERS)}")
    return base, tuple(mods)


def make_system(name, model, hp, device):
    base, mods = split_name(name)
    if base.startswith("ds_zero"):
        return DeepSpeedSystem(int(base[len("ds_zero"):]), model, hp, mods)
    if name == "fsdp2":
        return FSDP2System(model, hp, device)
    if name == "ddp":
        return DDPSystem(model, hp, device)
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")


def _adamw(params, hp, device):
    return torch.optim.AdamW(params,
                             lr=hp["lr"],
                             betas=hp["betas"],
                             weight_decay=hp["weight_decay"],
                             fused=device.type == "cuda")


class DeepSpeedSystem:

    def __init__(self, stage, model, hp, mods=()):
        import deepspeed
        config = {
            "train_micro_batch_size_per_gpu": hp["micro_batch"],
            "gradient_accumulation_steps": hp["gas"],
            "bf16": {
                "enabled": True
            },
            "gradient_clipping": hp["clip"],
            "steps_per_print": 1 << 30,
            "optimizer": {
                "type": "AdamW",
                "params": {
                    "lr": hp["lr"],
                    "betas": list(hp["betas"]),
                    "weight_decay": hp["weight_decay"]
                }
            },
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": hp["bucket_size"],
                "overlap_comm": True,
                "contiguous_gradients": True,
                "stage3_prefetch_bucket_size": hp.get("unit_size", int(4e7)),
            },
        }
        zero = config["zero_optimization"]
        pin = bool(hp.get("pin_memory", True))
        if "offload" in mods or "zenflow" in mods:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
            if stage == 3 and "zenflow" not in mods:
                zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
        if "nvme" in mods:
            path = hp.get("nvme_path")
            if not path:
                raise ValueError("+nvme needs --nvme-path (a writable folder on the NVMe device)")
            zero["sub_group_size"] = NVME_SECTIONS["sub_group_size"]
            zero["offload_optimizer"] = dict(NVME_SECTIONS["offload_optimizer"],
                                             device="nvme",
                                             nvme_path=path,
                                             pin_memory=pin)
            if stage == 3:
                zero["offload_param"] = dict(NVME_SECTIONS["offload_param"],
                                             device="nvme",
                                             nvme_path=path,
                                             pin_memory=pin)
            config["aio"] = dict(NVME_SECTIONS["aio"])
        if "zenflow" in mods:
            zero["zenflow"] = dict(hp.get("zenflow") or {})
        if "deepcompile" in mods:  # here: engine.compile() (torch.compile, hooks eager); upstream: its DeepCompile
            config["compile"] = {"deepcompile": True}
        _merge(config, hp.get("ds_extra") or {})
        self.engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
        if "deepcompile" in mods:
            self.engine.compile()

    def step(self, micro_batches):
        total = 0.0
        for tokens, targets in micro_batches:
            loss = lm_loss(self.engine(tokens), targets)
            self.engine.backward(loss)
            self.engine.step()
            total = total + loss.detach()
        return total / len(micro_batches)

    def grad_norm(self):
        """The global gradient norm of the last optimizer step (before clipping), or None."""
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def close(self):
        self.engine.destroy()
        self.engine = None


def _merge(base, extra):
    """Merge the dict ``extra`` into ``base`` in place, nested dicts key by key."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _fully_shard_api():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6 kept FSDP2 under _composable
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


class FSDP2System:

    def __init__(self, model, hp, device):
        from torch.distributed.device_mesh import init_device_mesh
        fully_shard, MixedPrecisionPolicy = _fully_shard_api()
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(), ))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.model = model
        self.gas = hp["gas"]
        self.clip = hp["clip"]
        self.optimizer = _adamw(model.parameters(), hp, device)

    def step(self, micro_batches):
        total = 0.0
        for tokens, targets in micro_batches:
            loss = lm_loss(self.model(tokens), targets)
            (loss / self.gas).backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / len(micro_batches)

    def close(self):
        self.model = self.optimizer = None


class DDPSystem:

    def __init__(self, model, hp, device):
        from torch.nn.parallel import DistributedDataParallel
        device_ids = [device.index] if device.type == "cuda" else None
        self.model = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
        self.device_type = device.type
        self.gas = hp["gas"]
        self.clip = hp["clip"]
        self.optimizer = _adamw(model.parameters(), hp, device)

    def step(self, micro_batches):
        total = 0.0
        for i, (tokens, targets) in enumerate(micro_batches):
            sync = i == len(micro_batches) - 1
            with contextlib.nullcontext() if sync else self.model.no_sync():
                with torch.autocast(self.device_type, dtype=torch.bfloat16):
                    logits = self.model(tokens)
                loss = lm_loss(logits, targets)
                (loss / self.gas).backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / len(micro_batches)

    def close(self):
        self.model = self.optimizer = None
