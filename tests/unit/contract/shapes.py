# SPDX-License-Identifier: Apache-2.0
"""The graph shapes of the gradient contract, each written once against a driver.

A shape function runs one micro-step: ``fn(drv, batch, t, rank)`` with ``t`` the
global micro-step index. ``Shape`` adds what the runner needs around it: which
models, the GAS of each engine relative to the cell's GAS, and the step protocol.
"""

from dataclasses import dataclass, field

import torch

from tests.unit.contract.models import Head, MoENet, TinyMoE, ToyNet, lm_loss


@dataclass(frozen=True)
class Shape:
    name: str
    fn: object
    models: tuple = ("toy", )
    gas_mult: tuple = (1, )  # GAS of engine i = cell GAS * gas_mult[i]
    protocol: str = "native"  # native | accelerate | trainer | unmanaged | coalesce | no_sync
    config: dict = field(default_factory=dict)


def build_model(kind):
    if kind == "toy":
        return ToyNet()
    if kind == "tied":
        return ToyNet(tie=True)
    if kind == "empty":
        return ToyNet(empty=True)
    if kind == "head":
        return Head()
    if kind == "moe":
        from deepspeed.utils import set_z3_leaf_modules
        model = MoENet()
        set_z3_leaf_modules(model, [TinyMoE])  # one unit, gathered whole: experts run data-dependently
        return model
    raise ValueError(kind)


def plain(d, batch, t, rank):
    tokens, targets = batch
    d.backward(lm_loss(d.fwd(0, tokens), targets))


def module_twice(d, batch, t, rank):
    tokens, targets = batch
    d.backward(lm_loss(d.fwd(0, tokens, twice=True), targets))


def _mixed_loss(d, batch):
    tokens, targets = batch
    out = d.fwd(0, tokens)
    model = d.models[0]
    side = model.block(model.emb(tokens))  # engine.module.sub(y), outside engine.forward
    return lm_loss(out, targets) + side.float().pow(2).mean()


def mixed_submodule(d, batch, t, rank):
    d.backward(_mixed_loss(d, batch))


def mixed_submodule_direct(d, batch, t, rank):
    d.direct(_mixed_loss(d, batch))


def _two_losses(d, batch):
    tokens, targets = batch
    out = d.fwd(0, tokens)
    return lm_loss(out, targets), out.float().pow(2).mean()


def two_losses_retained(d, batch, t, rank):
    first, second = _two_losses(d, batch)
    d.backward(first, retain_graph=True)
    d.backward(second)


def two_losses_retained_zero_grad(d, batch, t, rank):
    first, second = _two_losses(d, batch)
    d.backward(first, retain_graph=True)
    d.zero_grad()  # discards the first backward (and the window so far)
    d.backward(second)


def two_losses_summed(d, batch, t, rank):
    first, second = _two_losses(d, batch)
    d.backward(first + second)


def _two_engine_loss(d, batch):
    tokens, targets = batch
    hidden = d.fwd(0, tokens, hidden=True)
    return lm_loss(d.fwd(1, hidden), targets)


def two_engines_backward(d, batch, t, rank):
    d.backward(_two_engine_loss(d, batch), i=0)


def two_engines_direct(d, batch, t, rank):
    d.direct(_two_engine_loss(d, batch))


def no_gas_scaling(d, batch, t, rank):
    tokens, targets = batch
    d.backward(lm_loss(d.fwd(0, tokens), targets), scale_wrt_gas=False)


def unused_param(d, batch, t, rank):
    # the aux branch runs on rank 0 only, on every other micro-step
    tokens, targets = batch
    d.backward(lm_loss(d.fwd(0, tokens, use_aux=(rank == 0 and t % 2 == 0)), targets))


def unused_param_all_ranks(d, batch, t, rank):
    # the aux branch runs on every rank except in the second of every three micro-steps
    tokens, targets = batch
    d.backward(lm_loss(d.fwd(0, tokens, use_aux=(t % 3 != 1)), targets))


def ckpt_reentrant(d, batch, t, rank):
    tokens, targets = batch
    d.backward(lm_loss(d.fwd(0, tokens, twice=True, ckpt="reentrant"), targets))


def ckpt_non_reentrant(d, batch, t, rank):
    tokens, targets = batch
    d.backward(lm_loss(d.fwd(0, tokens, twice=True, ckpt="non_reentrant"), targets))


def ckpt_early_stop(d, batch, t, rank):
    tokens, targets = batch
    d.backward(lm_loss(d.fwd(0, tokens, residual=True, ckpt="non_reentrant"), targets))


def non_scalar(d, batch, t, rank):
    tokens, _ = batch
    out = d.fwd(0, tokens)
    gen = torch.Generator().manual_seed(100 * rank + t)
    d.direct(out, grad=torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype))


def scale_backward(d, batch, t, rank):
    tokens, targets = batch
    d.scaled(lm_loss(d.fwd(0, tokens), targets))


def trainer_protocol(d, batch, t, rank):
    tokens, targets = batch
    d.backward(lm_loss(d.fwd(0, tokens), targets) / d.gas[0], scale_wrt_gas=False)


def varying_backward_calls(d, batch, t, rank):
    tokens, targets = batch
    for k in range(1 + t % 3):
        d.backward(lm_loss(d.fwd(0, (tokens + k) % 16), targets))


def three_backward_calls(d, batch, t, rank):
    tokens, targets = batch
    for k in range(3):
        d.backward(lm_loss(d.fwd(0, (tokens + k) % 16), targets))


SHAPES = {
    s.name: s
    for s in [
        Shape("plain", plain),
        Shape("module_twice", module_twice),
        Shape("mixed_submodule", mixed_submodule),
        Shape("mixed_submodule_direct", mixed_submodule_direct),
        Shape("two_losses_retained", two_losses_retained),
        Shape("two_losses_retained_zero_grad", two_losses_retained_zero_grad),
        Shape("two_losses_summed", two_losses_summed),
        Shape("two_engines_backward", two_engines_backward, models=("toy", "head"), gas_mult=(1, 1)),
        Shape("two_engines_direct", two_engines_direct, models=("toy", "head"), gas_mult=(1, 1)),
        Shape("two_engines_backward_diff_gas", two_engines_backward, models=("toy", "head"), gas_mult=(1, 2)),
        Shape("two_engines_direct_diff_gas", two_engines_direct, models=("toy", "head"), gas_mult=(1, 2)),
        Shape("no_gas_scaling", no_gas_scaling),
        Shape("unused_param", unused_param),
        Shape("unused_param_all_ranks", unused_param_all_ranks),
        Shape("ckpt_reentrant", ckpt_reentrant),
        Shape("ckpt_non_reentrant", ckpt_non_reentrant),
        Shape("ckpt_early_stop", ckpt_early_stop),
        Shape("tied_weights", plain, models=("tied", )),
        Shape("moe_leaf", plain, models=("moe", )),
        Shape("zero_sized_param", plain, models=("empty", )),
        Shape("non_scalar", non_scalar),
        Shape("scale_backward", scale_backward),
        Shape("protocol_accelerate", plain, protocol="accelerate"),
        Shape("protocol_trainer", trainer_protocol),
        Shape(
            "unmanaged", varying_backward_calls, protocol="unmanaged", config={"managed_gradient_accumulation": False
                                                                               }),
        Shape("coalesce", three_backward_calls, protocol="coalesce"),
        Shape("n_backward_per_step", three_backward_calls),
        Shape("no_sync", plain, protocol="no_sync"),
    ]
}
