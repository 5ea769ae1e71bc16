# SPDX-License-Identifier: Apache-2.0
"""The model, data and config of the upstream checkpoint fixtures (shared by ``write_fixtures.py`` and the tests).

Plain torch only: ``write_fixtures.py`` imports it under upstream DeepSpeed, the tests under this package.
A 3-layer MLP whose parameter count is odd (47) and that has a 1-wide layer, so that flat partitions on 2
ranks need padding and some parameters straddle the ranks.
"""

import torch

GAS = 2
MICRO = 2
LR = 0.01
WEIGHT_DECAY = 0.01
CLIP = 1.0


class MLP(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 5)
        self.fc2 = torch.nn.Linear(5, 3)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def build_model(seed=0):
    torch.manual_seed(seed)
    return MLP()


def batch(step, micro, rank):
    """The inputs and targets of one micro-step of one rank (the same whoever asks)."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(MICRO, 4, generator=gen)
    y = torch.randn(MICRO, 1, generator=gen)
    return x, y


def loss_fn(out, y):
    return ((out.float() - y.to(out.device))**2).mean()


def torch_dtype(dtype):
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def cell_name(stage, dtype, offload, fp32acc=False):
    return f"z{stage}-{dtype}" + ("-fp32acc" if fp32acc else "") + ("-offload" if offload else "")


def parse_cell(name):
    """``(stage, dtype, offload, fp32acc)`` of a cell name such as ``z2-bf16-offload``."""
    parts = name.split("-")
    return int(parts[0][1:]), parts[1], "offload" in parts, "fp32acc" in parts


def ds_config(stage, dtype, offload, world, fp32acc=False):
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": LR,
                "weight_decay": WEIGHT_DECAY,
                "torch_adam": True
            }
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": LR,
                "warmup_num_steps": 4
            }
        },
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2}
    if fp32acc:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config
