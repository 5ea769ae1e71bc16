# SPDX-License-Identifier: Apache-2.0
"""Comet, imported only when ``comet.enabled`` is true."""

from .monitor import Monitor, check_events
from .utils import require_package


class CometMonitor(Monitor):
    """A Comet experiment from ``comet_ml.start(...)``; each event name is logged at most once every
    ``samples_log_interval`` samples (its first event always is)."""

    def __init__(self, comet_config):
        super().__init__(comet_config)
        self.samples_log_interval = comet_config.samples_log_interval
        self._last_logged = {}
        self.experiment = None
        if not self.enabled:
            return
        comet_ml = require_package("comet_ml", "comet")
        self.experiment = comet_ml.start(api_key=comet_config.api_key,
                                         project=comet_config.project,
                                         workspace=comet_config.workspace,
                                         experiment_key=comet_config.experiment_key,
                                         mode=comet_config.mode,
                                         online=comet_config.online)
        if comet_config.experiment_name is not None:
            self.experiment.set_name(comet_config.experiment_name)

    def _due(self, name, step):
        last = self._last_logged.get(name)
        if last is None or step - last >= self.samples_log_interval:
            self._last_logged[name] = step
            return True
        return False

    def write_events(self, event_list):
        if self.experiment is None:
            return
        for name, value, step in check_events(event_list):
            if self._due(name, step):
                self.experiment.log_metric(name, value, step=step)

    def update_config(self, config_dict):
        if self.experiment is not None:
            self.experiment.log_parameters(config_dict)

    def close(self):
        if self.experiment is not None:
            end = getattr(self.experiment, "end", None)
            if end is not None:
                end()
            self.experiment = None
