# SPDX-License-Identifier: Apache-2.0
"""Negative controls: a deliberately wrong gradient is reported as a mismatch on every rank, naming the group.

The model has four named param groups (``trunk``, ``late``, ``head``, ``aux``). One window is
trained and audited as it is (the positive control: ``ok``), then the window gradient is
damaged and audited again:

* ``scale_rank``: one rank's pieces of the whole gradient times 2 (on stage 0 that rank's
  replica; on stages 1-3 its partitions);
* ``scale_rank_group``: the same for the ``late`` group only; the report names ``late``;
* ``zero_group``: the ``late`` group's gradient zeroed on every rank; the report names ``late``;

and two wrong training losses, where ``loss_fn`` is the loss the user meant:

* ``detached_params``: training uses the auxiliary branch's parameters detached; the report
  names ``aux``;
* ``detached_branch``: training detaches the auxiliary branch's output, which also cuts the
  path through the branch into the layers below it: the report names ``aux`` and ``late``
  (and possibly ``trunk``, whose share is small), never ``head``;
* ``reduced_twice``: training divides the loss by GAS before ``engine.backward``, which
  divides again; every group is wrong by a factor GAS.

Every rank must return the same report.
"""

import pytest
import torch

from tests.unit.common import run_distributed

GROUPS = {"trunk": ("emb.", "block."), "late": ("block2.", ), "head": ("head.", ), "aux": ("aux.", )}
GAS = 4


def _model():
    from tests.unit.contract.models import ToyNet

    class BranchNet(ToyNet):
        """ToyNet whose auxiliary branch always runs; ``detach`` cuts its parameters or its output from autograd."""

        def forward(self, tokens, detach=None):
            h = self.body(self.emb(tokens))
            if detach == "params":
                side = torch.sigmoid(torch.nn.functional.linear(h, self.aux.weight.detach(), self.aux.bias.detach()))
            else:
                side = torch.sigmoid(self.aux(h))
            return self.head(h + (side.detach() if detach == "branch" else side))

    torch.manual_seed(0)
    return BranchNet()


def _engine(stage, dtype):
    import deepspeed
    model = _model()
    named = list(model.named_parameters())
    groups = [{
        "name": name,
        "params": [p for n, p in named if n.startswith(prefixes)]
    } for name, prefixes in GROUPS.items()]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 1e9,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 64,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 100
        }
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return deepspeed.initialize(model=model, optimizer=torch.optim.SGD(groups, lr=0.1), config=config)[0]


def _loss(engine, batch, **kwargs):
    from tests.unit.contract.models import lm_loss
    tokens, targets = batch
    return lm_loss(engine(tokens, **kwargs), targets)


def _params_of(engine, group):
    return [p for n, p in engine.module.named_parameters() if n.startswith(GROUPS[group])]


def _damage(engine, case, rank):
    from deepspeed.utils import safe_set_full_grad
    stage = engine._stage
    if case in ("scale_rank", "scale_rank_group") and rank == 1:
        params = stage.params if case == "scale_rank" else _params_of(engine, "late")
        held = 0
        for p in params:
            start, length = stage.local_range(p)
            stage.local_grad(p).reshape(-1)[:length].mul_(2.0)
            held += length
        assert held > 0, "rank 1 holds no piece of the damaged parameters: the control would test nothing"
    elif case == "zero_group":
        for p in _params_of(engine, "late"):
            safe_set_full_grad(p, torch.zeros(tuple(getattr(p, "ds_shape", p.shape))))


def control(case, stage, dtype):
    import deepspeed.comm as dist
    from tests.unit.audit.harness import report_tuple
    from tests.unit.contract.models import make_batch
    rank = dist.get_rank()
    engine = _engine(stage, dtype)
    batches = [make_batch(rank, t) for t in range(GAS)]
    train_kwargs = {"detach": case[len("detached_"):]} if case.startswith("detached") else {}
    try:
        for i, batch in enumerate(batches):
            loss = _loss(engine, batch, **train_kwargs)
            engine.backward(loss / GAS if case == "reduced_twice" else loss)
            if i < GAS - 1:
                engine.step()
        reports = []
        if case.startswith(("scale", "zero")):
            reports.append(engine.audit_gradients(_loss, batches))  # before the damage: must pass
            _damage(engine, case, rank)
        report = engine.audit_gradients(_loss, batches)
        reports.append(report)
        groups = [(g.name, g.mismatch, g.relative_error) for g in report.groups]
        return [report_tuple(r) for r in reports], groups, report.summary()
    finally:
        engine.destroy()


EXPECTED = {
    "scale_rank": None,  # every group rank 1 holds a piece of may be named
    "scale_rank_group": ("late", ),
    "zero_group": ("late", ),
    "detached_params": ("aux", ),
    "detached_branch": None,
    "reduced_twice": None,
}


def _verify(case, per_rank, dtype="fp32"):
    reports, groups, summary = per_rank[0]
    assert all(r == per_rank[0] for r in per_rank), "the ranks' reports differ"
    if len(reports) == 2:
        assert reports[0][0], f"the undamaged gradient failed the audit: {reports[0]}"
    ok, max_rel, rel, dominant, tol, skipped = reports[-1]
    assert not ok and max_rel > tol, f"{case}: the wrong gradient passed the audit: {summary}"
    assert "MISMATCH" in summary
    expected = EXPECTED[case]
    if expected is not None:
        assert dominant == expected, (dominant, groups)
    elif case == "detached_branch":
        assert {"aux", "late"} <= set(dominant) and "head" not in dominant, (dominant, groups)
    elif case == "reduced_twice":
        # Every group is off by a factor GAS. A group is named when its own error stands out against the
        # larger of its own sensitivity and the model's: in bf16 ``aux`` (a tenth of the gradient norm) need not.
        named = set(GROUPS) if dtype == "fp32" else {"trunk", "late", "head"}
        assert named <= set(dominant), (dominant, groups)
    else:
        assert dominant, groups


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_wrong_gradient_is_reported_on_every_rank(case, stage):
    _verify(case, run_distributed(control, 2, args=(case, stage, "fp32"), timeout=90))


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("case", ["scale_rank", "zero_group", "reduced_twice"])
def test_wrong_gradient_is_reported_in_bf16(case, stage):
    _verify(case, run_distributed(control, 2, args=(case, stage, "bf16"), timeout=90), "bf16")


@pytest.mark.parametrize("case", ["zero_group", "detached_params"])
def test_wrong_gradient_is_reported_on_one_rank(case):
    _verify(case, run_distributed(control, 1, args=(case, 2, "fp32"), timeout=90))
