# SPDX-License-Identifier: Apache-2.0
"""TensorBoard event files through ``torch.utils.tensorboard`` (the ``tensorboard`` package, an optional extra)."""

import json

from .monitor import Monitor, check_events
from .utils import prepare_log_dir, require_package


class TensorBoardMonitor(Monitor):
    """Scalars ``add_scalar(name, value, step)`` in ``<output_path>/<job_name>/``, flushed after every write.

    Construct it on the rank that writes (the engine builds it on global rank 0 only): it creates the directory.
    """

    def __init__(self, tensorboard_config):
        super().__init__(tensorboard_config)
        self.summary_writer = None
        self.output_path = tensorboard_config.output_path
        self.job_name = tensorboard_config.job_name
        self.log_dir = None
        if not self.enabled:
            return
        require_package("tensorboard", "tensorboard", extra="tensorboard")
        writer_module = require_package("torch.utils.tensorboard",
                                        "tensorboard",
                                        package="tensorboard",
                                        extra="tensorboard")
        self.log_dir = prepare_log_dir("tensorboard", self.output_path, self.job_name)
        self.summary_writer = writer_module.SummaryWriter(log_dir=self.log_dir)

    def get_summary_writer(self):
        return self.summary_writer

    def write_events(self, event_list, flush=True):
        if self.summary_writer is None:
            return
        for name, value, step in check_events(event_list):
            self.summary_writer.add_scalar(name, value, step)
        if flush:
            self.summary_writer.flush()

    def update_config(self, config_dict):
        if self.summary_writer is not None:
            self.summary_writer.add_text("DeepSpeed/config", json.dumps(config_dict, indent=2, default=str), 0)

    def flush(self):
        if self.summary_writer is not None:
            self.summary_writer.flush()

    def close(self):
        if self.summary_writer is not None:
            self.summary_writer.close()
            self.summary_writer = None
