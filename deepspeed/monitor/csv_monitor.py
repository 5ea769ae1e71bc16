# SPDX-License-Identifier: Apache-2.0
"""Events as CSV files, with the standard library only.

Layout (upstream's): one file per event name in ``<output_path>/<job_name>/``; the file name is the event name with
``/`` and spaces replaced by ``_`` plus ``.csv`` (``Train/Samples/train_loss`` ->
``Train_Samples_train_loss.csv``); its first row is ``step,<last part of the name>``, then one ``step,value`` row per
event.
"""

import csv
import os

from .monitor import Monitor, check_events
from .utils import prepare_log_dir


def csv_file_name(event_name):
    return event_name.replace("/", "_").replace(" ", "_") + ".csv"


class CSVMonitor(Monitor):
    """See the module docstring. Construct it on the rank that writes: it creates the directory."""

    def __init__(self, csv_config):
        super().__init__(csv_config)
        self.output_path = csv_config.output_path
        self.job_name = csv_config.job_name
        self.log_dir = prepare_log_dir("csv_monitor", self.output_path, self.job_name) if self.enabled else None

    def write_events(self, event_list):
        if self.log_dir is None:
            return
        rows = {}
        for name, value, step in check_events(event_list):
            rows.setdefault(name, []).append((step, value))
        for name, values in rows.items():
            path = os.path.join(self.log_dir, csv_file_name(name))
            new_file = not os.path.exists(path) or os.path.getsize(path) == 0
            with open(path, "a", newline="") as handle:
                writer = csv.writer(handle)
                if new_file:
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerows(values)

    def update_config(self, config_dict):
        if self.log_dir is None:
            return
        with open(os.path.join(self.log_dir, "deepspeed_config.csv"), "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["key", "value"])
            for key, value in config_dict.items():
                writer.writerow([key, value])

    def close(self):
        self.log_dir = None


# Upstream's spelling of the class name.
csvMonitor = CSVMonitor
