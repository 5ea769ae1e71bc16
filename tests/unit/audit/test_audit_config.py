# SPDX-License-Identifier: Apache-2.0
"""The ``gradient_audit`` config section: parsing, and the audit at accumulation boundaries during training.

* Parsing: defaults, and a bad or unknown key raises naming it (locally, so on every rank).
* Training (2 ranks): audits run at optimizer steps 0, n, 2n, ...; the result goes to the
  monitor (``Train/Audit/rel_error`` at ``global_samples`` before the update) and the log;
  the weights are those of the same training without the section.
* The micro-batches: by default the forward's inputs (a model that returns its loss), with
  each micro-step's generator state replayed, so a model with dropout passes (while a manual
  audit, which evaluates every micro-batch from one state, does not); or what the loop hands
  to ``record_audit_batch``; two engines in one graph, each auditing its own parameters.
* A mismatch warns on every rank, or raises on every rank before the optimizer steps; no
  registered loss function raises on every rank.
"""

import logging
import os

import pytest
import torch

from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from tests.unit.common import run_distributed
from tests.unit.monitor import training as M

GAS = 2


def _parse(section):
    return DeepSpeedConfig({"train_batch_size": 2, "gradient_audit": section}, world_size=1).gradient_audit_config


def test_defaults():
    cfg = DeepSpeedConfig({"train_batch_size": 2}, world_size=1).gradient_audit_config
    assert (cfg.enabled, cfg.every_n_steps, cfg.directions, cfg.tolerance, cfg.on_mismatch) == \
        (False, 1000, 4, None, "warn")
    cfg = _parse({"enabled": True, "every_n_steps": 5, "directions": 2, "tolerance": 0.5, "on_mismatch": "raise"})
    assert (cfg.enabled, cfg.every_n_steps, cfg.directions, cfg.tolerance, cfg.on_mismatch) == \
        (True, 5, 2, 0.5, "raise")


@pytest.mark.parametrize("section, needle", [
    ({
        "enabled": "yes"
    }, "gradient_audit.enabled"),
    ({
        "every_n_steps": 0
    }, "gradient_audit.every_n_steps"),
    ({
        "directions": 0
    }, "gradient_audit.directions"),
    ({
        "tolerance": 0
    }, "gradient_audit.tolerance"),
    ({
        "on_mismatch": "ignore"
    }, "gradient_audit.on_mismatch"),
    ({
        "seed": 3
    }, "unknown config key 'gradient_audit.seed'"),
])
def test_bad_keys_raise(section, needle):
    with pytest.raises(DeepSpeedConfigError, match=needle.replace(".", r"\.")):
        _parse(section)


class _Records(logging.Handler):

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append((record.levelname, record.getMessage()))


def _lossnet(dropout=0.0, detach=False):
    """ToyNet returning its own loss (the way Transformers models take labels): ``forward(tokens, targets)``."""
    from tests.unit.contract.models import ToyNet, lm_loss

    class LossNet(ToyNet):

        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(dropout)
            self.detach = detach  # train with the auxiliary branch cut off; the audit's loss keeps it

        def forward(self, tokens, targets, audited=False):
            h = self.drop(self.body(self.emb(tokens)))
            side = torch.sigmoid(self.aux(h))
            h = h + (side.detach() if self.detach and not audited else side)
            return lm_loss(self.head(h), targets)

    torch.manual_seed(0)
    return LossNet()


def _config(root=None, **audit):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 1e9,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "zero_optimization": {
            "stage": 2
        }
    }
    if audit:
        config["gradient_audit"] = dict({"enabled": True}, **audit)
    if root is not None:
        config["csv_monitor"] = {"enabled": True, "output_path": root, "job_name": "audit"}
    return config


def _forward_loss(engine, batch):
    """The registered loss function for recorded forward inputs: the model returns its loss."""
    return engine(*batch.args, **dict(batch.kwargs, audited=True))


def scheduled_run(root, dropout, audit, steps, detach=False):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param
    from deepspeed.utils.logging import logger
    from tests.unit.contract.models import make_batch
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    handler = _Records()
    logger.addHandler(handler)
    engine = deepspeed.initialize(model=_lossnet(dropout, detach), config=_config(root, **audit))[0]
    if audit:
        engine.set_audit_loss_fn(_forward_loss)
    reports, error = [], None
    try:
        for step in range(steps):
            for t in range(GAS):
                tokens, targets = make_batch(rank, step * GAS + t)
                engine.backward(engine(tokens, targets))
                try:
                    engine.step()
                except Exception as err:  # on_mismatch "raise": compared on every rank below
                    error = (type(err).__name__, str(err), engine.global_steps, engine.was_step_applied())
                    break
                if t == GAS - 1 and audit and engine._audit.last_report is not None:
                    reports.append((engine.global_steps, engine._audit.last_report.ok))
                    engine._audit.last_report = None
            if error:
                break
        weights = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
    finally:
        engine.destroy()
        logger.removeHandler(handler)
    dist.barrier()
    csv = M.read_csv_dir(os.path.join(root, "audit")) if root is not None and rank == 0 and audit else None
    return reports, weights, handler.messages, csv, error


def test_audits_run_at_every_nth_step_and_reach_the_monitor(tmp_path):
    audit = {"every_n_steps": 2}
    per_rank = run_distributed(scheduled_run, 2, args=(str(tmp_path), 0.3, audit, 4), timeout=90)
    plain = run_distributed(scheduled_run, 2, args=(None, 0.3, {}, 4), timeout=90)
    for rank in range(2):
        reports, weights, messages, _, error = per_rank[rank]
        assert error is None
        # steps 0 and 2 were audited (global_steps counts the step just taken), both passed: dropout was replayed
        assert reports == [(1, True), (3, True)], reports
        for a, b in zip(weights, plain[rank][1]):
            assert torch.equal(a, b)
    rank0_log = [m for level, m in per_rank[0][2] if "gradient audit ok" in m]
    assert len(rank0_log) == 2 and not [m for level, m in per_rank[1][2] if "gradient audit" in m]
    header, rows = per_rank[0][3]["Train_Audit_rel_error.csv"]
    batch = 2 * GAS * 2
    assert [step for step, _ in rows] == [0, 2 * batch]
    tol = 0.01
    assert all(0 <= value <= tol for _, value in rows), rows


def manual_with_dropout():
    """A manual audit of a model with dropout evaluates every micro-batch from one generator state."""
    import deepspeed
    import deepspeed.comm as dist
    from tests.unit.contract.models import make_batch
    rank = dist.get_rank()
    engine = deepspeed.initialize(model=_lossnet(0.3), config=_config())[0]
    try:
        batches = [make_batch(rank, t) for t in range(GAS)]
        for t, (tokens, targets) in enumerate(batches):
            engine.backward(engine(tokens, targets))
            if t < GAS - 1:
                engine.step()
        return engine.audit_gradients(lambda e, b: e(*b), batches).ok
    finally:
        engine.destroy()


def test_a_manual_audit_does_not_replay_dropout():
    # the contrast to the scheduled audit above: the masks differ from training's, so the gradient does not match
    assert run_distributed(manual_with_dropout, 2, timeout=60) == [False, False]


@pytest.mark.parametrize("on_mismatch", ["warn", "raise"])
def test_a_mismatch_warns_or_raises_on_every_rank(on_mismatch):
    audit = {"every_n_steps": 1, "on_mismatch": on_mismatch}
    per_rank = run_distributed(scheduled_run, 2, args=(None, 0.0, audit, 2, True), timeout=90)
    if on_mismatch == "raise":
        errors = [r[4] for r in per_rank]
        assert errors[0] == errors[1]
        kind, message, global_steps, applied = errors[0]
        assert kind == "GradientAuditError" and "MISMATCH" in message and "aux" in message
        assert global_steps == 0 and not applied  # raised before the optimizer step
    else:
        for reports, _, messages, _, error in per_rank:
            assert error is None and reports == [(1, False), (2, False)]
            warnings = [m for level, m in messages if level == "WARNING" and "MISMATCH" in m]
            assert len(warnings) == 2 and "aux" in warnings[0]


def no_loss_fn():
    import deepspeed
    import deepspeed.comm as dist
    from tests.unit.contract.models import make_batch
    engine = deepspeed.initialize(model=_lossnet(), config=_config(every_n_steps=1))[0]
    try:
        tokens, targets = make_batch(dist.get_rank(), 0)
        for _ in range(GAS):
            engine.backward(engine(tokens, targets))
            try:
                engine.step()
            except RuntimeError as err:
                return str(err)
    finally:
        engine.destroy()
    return None


def test_no_registered_loss_function_raises_on_every_rank():
    messages = run_distributed(no_loss_fn, 2, timeout=60)
    assert messages[0] == messages[1] and "set_audit_loss_fn" in messages[0]


def recorded_two_engines():
    """Two engines in one graph; the loop hands each its micro-batch; each audits its own parameters."""
    import deepspeed
    import deepspeed.comm as dist
    from tests.unit.contract.models import Head, ToyNet, lm_loss, make_batch
    rank = dist.get_rank()
    torch.manual_seed(0)
    trunk_model, head_model = ToyNet(), Head()
    cfg = _config(every_n_steps=1)
    cfg["zero_optimization"]["stage"] = 3
    trunk = deepspeed.initialize(model=trunk_model, config=cfg)[0]
    head = deepspeed.initialize(model=head_model, config=_config(every_n_steps=1))[0]
    # The trunk's loss runs the head (which has not stepped yet when the trunk does); the head's
    # loss starts from the trunk's features recorded in training (the trunk stepped before it).
    trunk.set_audit_loss_fn(lambda e, b: lm_loss(head(e(b[0], hidden=True)), b[1]))
    head.set_audit_loss_fn(lambda e, b: lm_loss(e(b[0]), b[1]))
    results = []
    try:
        for step in range(2):
            for t in range(GAS):
                tokens, targets = make_batch(rank, step * GAS + t)
                trunk.record_audit_batch((tokens, targets))
                hidden = trunk(tokens, hidden=True)
                head.record_audit_batch((hidden.detach(), targets))
                trunk.backward(lm_loss(head(hidden), targets))
                trunk.step()
                head.step()
            results.append((trunk._audit.last_report.ok, head._audit.last_report.ok,
                            tuple(g.name for g in trunk._audit.last_report.groups),
                            tuple(g.name for g in head._audit.last_report.groups)))
    finally:
        trunk.destroy()
        head.destroy()
    return results


def test_recorded_batches_and_two_engines():
    per_rank = run_distributed(recorded_two_engines, 2, timeout=90)
    assert per_rank[0] == per_rank[1]
    # one param group each: the groups of the report are the models' top-level modules
    assert per_rank[0] == [(True, True, ("emb", "block", "block2", "head", "aux"), ("proj", "out"))] * 2
