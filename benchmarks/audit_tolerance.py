# SPDX-License-Identifier: Apache-2.0
"""How large the gradient audit's error is for a true gradient, and for wrong ones, by dtype and step size.

The measurements behind the audit's default steps and tolerances (docs/audit.md). On one process (CPU or a GPU),
for a model and a dtype, each of ``--audits`` windows (GAS 2, ZeRO stage ``--stage``) is trained, and before its
step the audit is run, for every step size of ``--steps``, on

* the true window gradient;
* the gradient doubled;
* the gradient with the ``late`` group (the second block: ``block2`` of the contract's ToyNet, ``blocks.1`` of the
  GPT) zeroed;

with a tolerance of 1 (so nothing is localised) and the audit's largest error over its 4 directions kept. The
output, per step size: the largest and 90th-percentile error of the true gradient, and the smallest errors of the
wrong ones. A good step has the first far below the others; the tolerance goes between them.

    python benchmarks/audit_tolerance.py --model toy --dtype bf16 --steps 1e-2,3e-2,1e-1
    python benchmarks/audit_tolerance.py --model gpt --dtype bf16 --gpt 64,2,32,2 --steps 2e-2,3e-2
"""

import argparse
import os
import socket
import sys

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import torch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["toy", "gpt"], default="toy")
    parser.add_argument("--gpt", default="64,2,32,2", help="d_model,layers,seq,micro-batch of the GPT")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", default="1e-2,3e-2", help="comma-separated relative steps to try")
    parser.add_argument("--audits", type=int, default=20)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cpu")
    return parser.parse_args(argv)


def _single_process(device):
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"


def _model(args):
    torch.manual_seed(0)
    if args.model == "toy":
        from tests.unit.contract.models import VOCAB, ToyNet
        return ToyNet(), VOCAB, 3, 2, "block2."
    from benchmarks.gpt import GPT, GPTConfig
    d, layers, seq, micro = (int(x) for x in args.gpt.split(","))
    cfg = GPTConfig(d_model=d, n_layers=layers, n_heads=max(2, d // 64), vocab=512 if d > 64 else 128, seq=seq)
    return GPT(cfg), cfg.vocab, seq, micro, "blocks.1."


def _lm_loss(engine, batch):
    from benchmarks.gpt import lm_loss
    return lm_loss(engine(batch[0]), batch[1])


def run(args):
    import deepspeed
    import deepspeed.runtime.audit.report as report_module
    model, vocab, seq, micro, late_prefix = _model(args)
    gas = 2
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 1e9,
        "zero_optimization": {
            "stage": args.stage
        }
    }
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif args.dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                                  config=config)[0]
    stage = engine._stage
    late = [p for n, p in engine.module.named_parameters() if n.startswith(late_prefix)]
    steps = [float(s) for s in args.steps.split(",")]
    found = {s: {"true": [], "doubled": [], "late zeroed": []} for s in steps}
    default = report_module.PRECISIONS[args.dtype]
    device = engine.device

    def batch(t):
        gen = torch.Generator().manual_seed(1000 + t)
        return (torch.randint(0, vocab, (micro, seq),
                              generator=gen).to(device), torch.randint(0, vocab, (micro, seq),
                                                                       generator=gen).to(device))

    def audit_all(kind, window, seed):
        for s in steps:
            report_module.PRECISIONS[args.dtype] = (s, default[1])
            found[s][kind].append(engine.audit_gradients(_lm_loss, window, tolerance=1.0, seed=seed).max_rel_error)

    try:
        for a in range(args.audits):
            window = [batch(a * gas + t) for t in range(gas)]
            for t, b in enumerate(window):
                engine.backward(_lm_loss(engine, b))
                if t < gas - 1:
                    engine.step()
            stage.finish_window()
            saved = [stage.local_grad(p).clone() for p in stage.params]
            audit_all("true", window, a)
            for p in stage.params:
                stage.local_grad(p).mul_(2.0)
            audit_all("doubled", window, a)
            for p, g in zip(stage.params, saved):
                stage.local_grad(p).copy_(g)
            for p in late:
                stage.local_grad(p).zero_()
            audit_all("late zeroed", window, a)
            for p, g in zip(stage.params, saved):
                stage.local_grad(p).copy_(g)
            engine.step()
    finally:
        report_module.PRECISIONS[args.dtype] = default
        engine.destroy()
    return found


def main(argv=None):
    args = parse_args(argv)
    _single_process(args.device)
    found = run(args)
    name = args.model if args.model == "toy" else f"gpt {args.gpt}"
    print(f"| model | dtype | step | true: max | true: p90 | doubled: min | late zeroed: min |  ({args.audits} audits "
          f"of 4 directions, stage {args.stage})")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for step, errors in found.items():
        true = sorted(errors["true"])
        p90 = true[min(len(true) - 1, int(0.9 * len(true)))]
        print(f"| {name} | {args.dtype} | {step:g} | {true[-1]:.3g} | {p90:.3g} | {min(errors['doubled']):.3g} | "
              f"{min(errors['late zeroed']):.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
