# SPDX-License-Identifier: Apache-2.0
"""Pipeline test cases: small models, their data, and the plain-torch reference they are checked against.

A *case* is a dict (picklable, so ``run_distributed`` hands it to every rank):

    world, stages      ranks, pipeline stages (data parallel = world // stages)
    gas                micro-batches per batch
    zero, dtype        ZeRO stage, "fp32" / "bf16" / "fp16" (fp16 with a static loss scale)
    widths             layer widths of the MLP (d0 -> d1 -> ... ), tanh between linears
    partition          "uniform", "parameters" or a list of stage boundaries (``parts``)
    tied               an embedding tied with the output head (token inputs, cross entropy)
    ckpt               "", "reentrant" or "non_reentrant": activation checkpointing of every layer
    schedule           the config's pipeline.schedule (+ virtual_stages)
    optimizer, clip    "sgd" / "adam", gradient_clipping
    steps              optimizer steps

:func:`run_case` trains the pipeline on every rank and the reference on every rank (every rank computes
the whole reference: ``(1 / (gas * dp)) * sum over replicas and micro-batches of dL/dp``, in the model's
dtype per micro-batch, accumulated in fp32) and returns the largest differences of losses and parameters.
"""

import copy
import random

import torch
import torch.nn.functional as F

VOCAB = 11
SEQ = 3


class SeededEmbedding(torch.nn.Embedding):
    """An embedding whose initial weights depend only on ``seed`` (built on each stage that uses the tie)."""

    def __init__(self, num, dim, seed):
        super().__init__(num, dim)
        with torch.no_grad():
            self.weight.copy_(torch.randn(num, dim, generator=torch.Generator().manual_seed(seed)) * 0.5)


def head_fn(embedding, hidden):
    """The tied output head: logits from the embedding's weight."""
    return hidden @ embedding.weight.t()


class Mean(torch.nn.Module):
    """Mean over the sequence positions (a parameterless layer)."""

    def forward(self, x):
        return x.mean(dim=1)


def build_layers(case):
    """The case's layers, the same on every rank (a fixed seed)."""
    from deepspeed.pipe import TiedLayerSpec
    torch.manual_seed(case.get("seed", 0))
    widths = case["widths"]
    layers = []
    if case.get("tied"):
        layers.append(TiedLayerSpec("embed", SeededEmbedding, VOCAB, widths[0], 7))
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.Tanh())
    if case.get("tied"):
        layers.append(TiedLayerSpec("embed", SeededEmbedding, VOCAB, widths[0], 7, forward_fn=head_fn))
    return layers


def reference_modules(layers):
    """Plain-torch callables for the layers (a tie is one module used twice)."""
    from deepspeed.pipe import TiedLayerSpec
    tied, out = {}, []
    for layer in layers:
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in tied:
                tied[layer.key] = layer.build()
            module = tied[layer.key]
            out.append((module, layer.forward_fn))
        else:
            out.append((copy.deepcopy(layer), None))
    return out


def loss_fn_of(case):
    if case.get("tied"):
        return lambda logits, labels: F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))
    return lambda out, labels: F.mse_loss(out.float(), labels)


def batches(case, count):
    g = torch.Generator().manual_seed(case.get("data_seed", 1))
    mb = case.get("micro_batch", 2)
    out = []
    for _ in range(count):
        if case.get("tied"):
            x = torch.randint(0, VOCAB, (mb, SEQ), generator=g)
            out.append((x, torch.randint(0, VOCAB, (mb, SEQ), generator=g)))
        else:
            x = torch.randn(mb, case["widths"][0], generator=g).to(_dtype(case))  # inputs in the model's dtype
            out.append((x, torch.randn(mb, case["widths"][-1], generator=g)))
    return out


def config_of(case):
    cfg = {
        "train_micro_batch_size_per_gpu": case.get("micro_batch", 2),
        "gradient_accumulation_steps": case["gas"],
        "zero_optimization": {
            "stage": case.get("zero", 0)
        },
        "gradient_clipping": case.get("clip", 0.0),
        "steps_per_print": 10**6,
    }
    if case.get("optimizer", "sgd") == "adam":
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True, "weight_decay": 0.0}}
    else:
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    dtype = case.get("dtype", "fp32")
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 128}
    pipeline = {}
    if case.get("schedule"):
        pipeline["schedule"] = case["schedule"]
    if case.get("virtual_stages"):
        pipeline["virtual_stages"] = case["virtual_stages"]
    if case.get("ckpt") == "non_reentrant":
        pipeline["use_reentrant"] = False
    if pipeline:
        cfg["pipeline"] = pipeline
    return cfg


def _dtype(case):
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case.get("dtype", "fp32")]


class Reference:
    """The case's model trained by plain torch on the whole batch of every replica (module docstring)."""

    def __init__(self, case, layers):
        self.case = case
        self.calls = reference_modules(layers)
        self.modules = []
        for module, _ in self.calls:
            if isinstance(module, torch.nn.Module) and module not in self.modules:
                self.modules.append(module)
        self.params = [p for m in self.modules for p in m.parameters()]
        dtype = _dtype(case)
        for p in self.params:
            p.data = p.data.to(dtype)
        self.masters = [p.detach().clone().float() for p in self.params]  # masters of the 16-bit values
        self.loss_fn = loss_fn_of(case)
        lr = 0.01 if case.get("optimizer", "sgd") == "adam" else 0.1
        self.masters = [torch.nn.Parameter(m) for m in self.masters]
        self.opt = (torch.optim.Adam(self.masters, lr=lr)
                    if case.get("optimizer", "sgd") == "adam" else torch.optim.SGD(self.masters, lr=lr))
        self.scale = 128.0 if case.get("dtype") == "fp16" else 1.0

    def forward(self, x):
        for module, fn in self.calls:
            x = fn(module, x) if fn is not None else module(x)
        return x

    def step(self, micro_batches):
        """One optimizer step over ``micro_batches`` (every replica's); returns the mean loss."""
        n = len(micro_batches)
        acc = [torch.zeros_like(m) for m in self.masters]
        total = 0.0
        for x, y in micro_batches:
            loss = self.loss_fn(self.forward(x), y)
            total += float(loss.detach())
            grads = torch.autograd.grad(loss * self.scale, self.params, allow_unused=True)
            for a, g in zip(acc, grads):
                if g is not None:
                    a.add_(g.float(), alpha=1.0 / (n * self.scale))
        for m, a in zip(self.masters, acc):
            m.grad = a
        clip = self.case.get("clip", 0.0)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(self.masters, clip)
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
        return total / n

    def value_of(self, layer_index, attr):
        """The fp32 value of parameter ``attr`` of layer ``layer_index`` (ties resolve to their module)."""
        module, _ = self.calls[layer_index]
        param = dict(module.named_parameters())[attr]
        return self.masters[next(i for i, p in enumerate(self.params) if p is param)]


def run_case(case):
    """Train ``case`` on this rank and the reference; returns ``{"loss": max diff, "param": max rel diff, ...}``."""
    import deepspeed
    from deepspeed.pipe import PipelineModule, TiedLayerSpec
    from deepspeed.utils import safe_get_full_fp32_param
    layers = build_layers(case)
    reference = Reference(case, layers)
    partition = case.get("partition", "uniform")
    if isinstance(partition, str):
        model = PipelineModule(layers,
                               num_stages=case["stages"],
                               loss_fn=loss_fn_of(case),
                               partition_method=partition,
                               activation_checkpoint_interval=1 if case.get("ckpt") else 0)
    else:  # explicit boundaries, as a subclass overriding _partition_layers sets them
        model = _with_parts(layers, case, partition)
    engine, *_ = deepspeed.initialize(model=model, config=config_of(case))
    dp, dp_rank, gas = engine.grid.data_parallel_size, engine.grid.get_data_parallel_rank(), case["gas"]
    data = batches(case, case.get("steps", 2) * gas * dp)
    out = {"loss": 0.0, "param": 0.0, "losses": []}
    for step in range(case.get("steps", 2)):
        window = data[step * gas * dp:(step + 1) * gas * dp]
        mine = window[dp_rank * gas:(dp_rank + 1) * gas]
        loss = float(engine.train_batch(iter(mine)))
        expected = reference.step(window)
        out["losses"].append((loss, expected))
        out["loss"] = max(out["loss"], abs(loss - expected) / max(1e-6, abs(expected)))
    for name, param in engine.module.named_parameters():
        if name.startswith("tied_modules."):
            key = name.split(".")[1]
            index = next(i for i, s in enumerate(layers) if isinstance(s, TiedLayerSpec) and s.key == key)
            attr = name.split(".", 2)[2]
        else:
            index, attr = int(name.split(".")[0]), name.split(".", 1)[1]
        ours = safe_get_full_fp32_param(param)
        ours = (ours if ours is not None else param).detach().float()
        want = reference.value_of(index, attr).detach()
        out["param"] = max(out["param"], float((ours - want).abs().max() / want.abs().max().clamp(min=1e-6)))
    out["norm"] = engine.get_global_grad_norm()
    engine.destroy()
    return out


def _with_parts(layers, case, parts):
    from deepspeed.pipe import PipelineModule

    class Manual(PipelineModule):

        def _partition_layers(self, method="uniform"):
            self.parts = list(parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return Manual(layers,
                  num_stages=case["stages"],
                  loss_fn=loss_fn_of(case),
                  activation_checkpoint_interval=1 if case.get("ckpt") else 0)


def random_case(seed):
    """A case with random widths (1-wide layers included) and a random cut, from a seeded generator."""
    rng = random.Random(seed)
    stages = rng.choice([2, 3, 4])
    depth = rng.randint(stages, stages + 2)  # linears
    widths = [rng.choice([1, 2, 3, 5, 8]) for _ in range(depth + 1)]
    n_layers = 2 * depth - 1
    cuts = sorted(rng.sample(range(1, n_layers), stages - 1))
    return dict(world=stages,
                stages=stages,
                gas=rng.choice([1, 2, 3]),
                zero=rng.choice([0, 1, 2]),
                widths=widths,
                partition=[0] + cuts + [n_layers],
                optimizer=rng.choice(["sgd", "adam"]),
                clip=rng.choice([0.0, 0.05]),
                seed=seed,
                steps=2)
