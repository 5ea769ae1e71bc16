# SPDX-License-Identifier: Apache-2.0
"""Each monitor backend on its own (one process): the files or calls it makes for a list of events."""

import sys
import types

import pytest
import torch

from deepspeed.monitor.config import get_monitor_config
from deepspeed.monitor.monitor import MonitorMaster, check_events
from deepspeed.runtime.config_utils import DeepSpeedConfigError
from tests.unit.monitor.training import read_csv_dir, read_tensorboard_dir

EVENTS = [("Train/Samples/train_loss", torch.tensor(1.5), 0), ("Train/Samples/lr", 0.25, 16),
          ("Train/Samples/train_loss", 1.25, 16), ("Custom metric", 7, 32)]


def master(tmp_path, **sections):
    for section in ("tensorboard", "csv_monitor"):
        if section in sections:
            sections[section] = dict(output_path=str(tmp_path), **sections[section])
    return MonitorMaster(get_monitor_config(sections))


def test_csv_layout(tmp_path):
    monitor = master(tmp_path, csv_monitor={"enabled": True, "job_name": "job"})
    monitor.write_events(EVENTS[:2])
    monitor.write_events(EVENTS[2:])
    assert read_csv_dir(tmp_path / "job") == {
        "Train_Samples_train_loss.csv": (["step", "train_loss"], [(0, 1.5), (16, 1.25)]),
        "Train_Samples_lr.csv": (["step", "lr"], [(16, 0.25)]),
        "Custom_metric.csv": (["step", "Custom metric"], [(32, 7.0)]),
    }


def test_tensorboard_events(tmp_path):
    monitor = master(tmp_path, tensorboard={"enabled": True, "job_name": "tb"})
    monitor.write_events(EVENTS)
    monitor.close()
    assert read_tensorboard_dir(str(tmp_path / "tb")) == {
        "Train/Samples/train_loss": [(0, 1.5), (16, 1.25)],
        "Train/Samples/lr": [(16, 0.25)],
        "Custom metric": [(32, 7.0)],
    }
    monitor.write_events(EVENTS)  # closed: nothing happens


def test_disabled_monitor_builds_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monitor = MonitorMaster(get_monitor_config({}))
    assert not monitor.enabled and monitor.monitors == []
    monitor.write_events(EVENTS)
    assert list(tmp_path.iterdir()) == []


class _FakeWandb(types.ModuleType):

    def __init__(self):
        super().__init__("wandb")
        self.calls = []
        self.config = types.SimpleNamespace(update=lambda d, allow_val_change: self.calls.append(("config", d)))

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))

    def log(self, data, step=None, commit=None):
        self.calls.append(("log", data, step))

    def finish(self):
        self.calls.append(("finish", ))


def test_wandb_calls(monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monitor = MonitorMaster(get_monitor_config({"wandb": {"enabled": True, "team": "t", "group": "g"}}))
    monitor.write_events(EVENTS[:2])
    monitor.update_config({"a": 1})
    monitor.close()
    assert fake.calls == [("init", dict(project="deepspeed", group="g", entity="t")),
                          ("log", {
                              "Train/Samples/train_loss": 1.5
                          }, 0), ("log", {
                              "Train/Samples/lr": 0.25
                          }, 16), ("config", {
                              "a": 1
                          }), ("finish", )]


def test_wandb_missing_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="'wandb' package is not installed: pip install wandb"):
        MonitorMaster(get_monitor_config({"wandb": {"enabled": True}}))


def test_comet_logs_at_most_every_interval(monkeypatch):
    calls = []

    class Experiment:

        def log_metric(self, name, value, step=None):
            calls.append((name, value, step))

        def set_name(self, name):
            calls.append(("name", name))

    fake = types.ModuleType("comet_ml")
    fake.start = lambda **kwargs: calls.append(("start", kwargs["project"], kwargs["mode"])) or Experiment()
    monkeypatch.setitem(sys.modules, "comet_ml", fake)
    monitor = MonitorMaster(
        get_monitor_config({
            "comet": {
                "enabled": True,
                "project": "p",
                "mode": "create",
                "experiment_name": "run",
                "samples_log_interval": 20
            }
        }))
    monitor.write_events([("loss", 1.0, 0), ("loss", 2.0, 16), ("loss", 3.0, 20), ("lr", 0.1, 16)])
    assert calls == [("start", "p", "create"), ("name", "run"), ("loss", 1.0, 0), ("loss", 3.0, 20), ("lr", 0.1, 16)]


def test_unwritable_output_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DeepSpeedConfigError, match="tensorboard.output_path"):
        MonitorMaster(get_monitor_config({"tensorboard": {"enabled": True, "output_path": str(blocker)}}))


@pytest.mark.parametrize("event, words", [
    (("name", 1.0), "(name, value, step)"),
    (("", 1.0, 0), "non-empty string"),
    (("name", "high", 0), "must be a number"),
    (("name", torch.ones(2), 0), "scalar"),
    (("name", 1.0, 1.5), "integer"),
])
def test_malformed_events(event, words):
    with pytest.raises((ValueError, TypeError), match=words.replace("(", r"\(").replace(")", r"\)")):
        check_events([event])


def test_comet_mode_is_checked():
    with pytest.raises(DeepSpeedConfigError, match="comet.mode"):
        get_monitor_config({"comet": {"mode": "sometimes"}})
