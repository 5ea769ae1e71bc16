# SPDX-License-Identifier: Apache-2.0
"""Setup checks shared by the monitor backends: a writable log directory, an optional package."""

import importlib
import os
import tempfile

from deepspeed.runtime.config_utils import DeepSpeedConfigError


def prepare_log_dir(section, output_path, job_name):
    """Create ``<output_path>/<job_name>`` and prove it writable by creating and removing a file in it.

    Returns the directory's path. Raises :class:`DeepSpeedConfigError` naming ``<section>.output_path`` when the
    directory cannot be created or written (a path under a regular file, a read-only file system, missing
    permissions); the probe is a real write because permission bits say nothing for root.
    """
    log_dir = os.path.join(output_path, job_name) if output_path else job_name
    try:
        os.makedirs(log_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=log_dir, prefix=".ds_write_probe_"):
            pass
    except OSError as err:
        raise DeepSpeedConfigError(f"config key '{section}.output_path' ({output_path!r}): cannot write the log "
                                   f"directory {log_dir!r}: {err.strerror or err}") from err
    return log_dir


def require_package(module, section, package=None, extra=None):
    """Import and return ``module``; if it is missing, raise ImportError saying which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = package or module
        hint = f"pip install {package}" + (f" (or pip install deepspeed[{extra}])" if extra else "")
        raise ImportError(f"config key '{section}.enabled' is true, but the '{package}' package is not installed: "
                          f"{hint}") from err
