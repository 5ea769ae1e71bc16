# SPDX-License-Identifier: Apache-2.0
"""Train the small GPT of ``model.py`` on a synthetic token stream with DeepSpeed.

Run with the launcher, e.g. ``deepspeed --num_gpus 2 examples/gpt/train.py --steps 20`` (on a machine without
GPUs, ``--num_gpus`` is the number of CPU processes). The data is a fixed random pattern of tokens repeated
forever, so the next token is predictable and the loss falls within a few steps. Rank 0 prints the loss every
``--log_interval`` optimizer steps and a final line with the throughput in tokens/s.

Precision defaults to bf16 on a CUDA machine and fp32 otherwise, unless the config enables fp16 or bf16 itself or
``--dtype`` says otherwise; ``--zero_stage`` overrides ``zero_optimization.stage``. ``--offload`` keeps the optimizer
state (and, at ZeRO-3, the parameters) in CPU memory. Ready-made configs for that:
``--deepspeed_config examples/gpt/ds_config_zero2_offload.json`` (ZeRO-2, optimizer offload) and
``examples/gpt/ds_config_zero3_offload.json`` (ZeRO-3, optimizer and parameter offload); docs/zero.md explains
every key.
"""

import argparse
import json
import os
import time

import torch

import deepspeed
from model import GPT, GPTConfig

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Train a small GPT on synthetic data with DeepSpeed.")
    parser.add_argument("--steps",
                        type=int,
                        default=20,
                        help="Optimizer steps (each of gradient_accumulation_steps "
                        "micro-batches).")
    parser.add_argument("--deepspeed_config", type=str, default=DEFAULT_CONFIG, help="DeepSpeed JSON config.")
    parser.add_argument("--zero_stage", type=int, choices=[0, 1, 2, 3], default=None, help="Override ZeRO stage.")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="Override precision.")
    parser.add_argument("--offload",
                        action="store_true",
                        help="Keep the optimizer state in CPU memory (ZeRO stage 1-3), and at ZeRO-3 the parameters "
                        "too.")
    parser.add_argument("--log_interval", type=int, default=5, help="Print the loss every this many steps.")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab_size", type=int, default=256)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--n_layers", type=int, default=2)
    parser.add_argument("--n_heads", type=int, default=4)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="Set by the launcher; unused.")
    return parser.parse_args(argv)


def load_config(path, zero_stage=None, dtype=None, cuda=False, offload=False):
    """Read the DeepSpeed config at ``path`` and apply the command-line overrides.

    ``dtype`` None keeps the config's fp16/bf16 sections when one is enabled, else picks bf16 when ``cuda`` and
    fp32 otherwise. ``offload`` adds ``offload_optimizer`` (and at stage 3 ``offload_param``) on the CPU, pinned
    when ``cuda``; it needs a ZeRO stage of 1 or more (stage 0 keeps no optimizer state of its own to move).
    """
    with open(path, encoding="utf-8") as handle:
        config = json.load(handle)
    if zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = zero_stage
    if offload:
        zero = config.setdefault("zero_optimization", {})
        stage = zero.get("stage", 0)
        if stage == 0:
            raise SystemExit("train.py: --offload needs ZeRO stage 1, 2 or 3: add --zero_stage 2 (or 3, which "
                             "offloads the parameters too)")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    if dtype is None:
        if any(config.get(section, {}).get("enabled", False) for section in ("fp16", "bf16")):
            return config
        dtype = "bf16" if cuda else "fp32"
    config.setdefault("fp16", {})["enabled"] = dtype == "fp16"
    config.setdefault("bf16", {})["enabled"] = dtype == "bf16"
    return config


class RepeatingPatternData:
    """Windows of an endless stream that repeats one fixed random pattern of tokens.

    The pattern is the same on every rank (seeded by ``seed``); window positions differ per rank. ``batch``
    returns ``(tokens, targets)`` of shape (batch, seq_len), targets being the tokens shifted by one.
    """

    def __init__(self, vocab_size, seq_len, seed, rank, period=97):
        pattern_rng = torch.Generator().manual_seed(seed)
        self.pattern = torch.randint(vocab_size, (period, ), generator=pattern_rng)
        self.seq_len = seq_len
        self.offsets_rng = torch.Generator().manual_seed(seed + 1 + rank)

    def batch(self, batch_size, device):
        period = self.pattern.numel()
        starts = torch.randint(period, (batch_size, 1), generator=self.offsets_rng)
        window = self.pattern[(starts + torch.arange(self.seq_len + 1)) % period]
        return window[:, :-1].to(device), window[:, 1:].to(device)


def main(argv=None):
    args = parse_args(argv)
    deepspeed.init_distributed()
    config = load_config(args.deepspeed_config,
                         args.zero_stage,
                         args.dtype,
                         cuda=torch.cuda.is_available(),
                         offload=args.offload)

    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = GPT(
        GPTConfig(vocab_size=args.vocab_size,
                  seq_len=args.seq_len,
                  d_model=args.d_model,
                  n_layers=args.n_layers,
                  n_heads=args.n_heads))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    rank = engine.global_rank
    world_size = engine.dp_world_size
    micro_batch = engine.train_micro_batch_size_per_gpu()
    accumulation = engine.gradient_accumulation_steps()
    data = RepeatingPatternData(args.vocab_size, args.seq_len, args.seed, rank)
    if rank == 0:
        precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
        zero = config.get("zero_optimization", {})
        offloaded = [what for what in ("optimizer", "param") if zero.get(f"offload_{what}", {}).get("device") == "cpu"]
        print(
            f"world {world_size}, ZeRO stage {engine.zero_optimization_stage()}, {precision}, micro-batch "
            f"{micro_batch} x {accumulation} accumulation steps, device {engine.device}, offload to CPU: "
            f"{' and '.join(offloaded) or 'none'}",
            flush=True)

    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        step_loss = 0.0
        # The engine counts micro-batches: step() only updates the weights at the accumulation boundary.
        for _ in range(accumulation):
            tokens, targets = data.batch(micro_batch, engine.device)
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / accumulation
        if rank == 0 and (step == 1 or step % args.log_interval == 0 or step == args.steps):
            print(f"step {step:4d} | loss {step_loss:.4f} | lr {engine.get_lr()[0]:.2e}", flush=True)
    elapsed = time.perf_counter() - start

    tokens_seen = args.steps * accumulation * micro_batch * args.seq_len * world_size
    if rank == 0:
        print(
            f"done: {args.steps} steps, {tokens_seen} tokens in {elapsed:.1f} s, {tokens_seen / elapsed:.0f} tokens/s",
            flush=True)
    engine.destroy()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
