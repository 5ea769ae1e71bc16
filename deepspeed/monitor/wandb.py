# SPDX-License-Identifier: Apache-2.0
"""Weights & Biases, imported only when ``wandb.enabled`` is true."""

from .monitor import Monitor, check_events
from .utils import require_package


class WandbMonitor(Monitor):
    """``wandb.init(project, group, entity=team)`` at construction, then ``wandb.log({name: value}, step=step)``.

    W&B requires steps that never decrease within a run; the engine's events use ``global_samples``, which only
    grows.
    """

    def __init__(self, wandb_config):
        super().__init__(wandb_config)
        self.group = wandb_config.group
        self.team = wandb_config.team
        self.project = wandb_config.project
        self._wandb = None
        if self.enabled:
            self._wandb = require_package("wandb", "wandb")
            self._wandb.init(project=self.project, group=self.group, entity=self.team)

    def log(self, data, step=None, commit=None):
        if self._wandb is not None:
            return self._wandb.log(data, step=step, commit=commit)
        return None

    def write_events(self, event_list):
        if self._wandb is None:
            return
        for name, value, step in check_events(event_list):
            self.log({name: value}, step=step)

    def update_config(self, config_dict):
        if self._wandb is not None:
            self._wandb.config.update(config_dict, allow_val_change=True)

    def close(self):
        if self._wandb is not None:
            finish = getattr(self._wandb, "finish", None)
            if finish is not None:
                finish()
            self._wandb = None
