# SPDX-License-Identifier: Apache-2.0
"""The monitor, comms logger, flops profiler and eigenvalue sections: upstream's defaults; unknown keys and bad
values raise naming the key."""

import pytest

from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError


def make(**sections):
    return DeepSpeedConfig(dict(train_batch_size=2, **sections), world_size=1)


def test_upstream_defaults():
    cfg = make()
    monitor = cfg.monitor_config
    assert not monitor.enabled
    assert (monitor.tensorboard.enabled, monitor.tensorboard.output_path, monitor.tensorboard.job_name) == \
        (False, "", "DeepSpeedJobName")
    assert (monitor.csv_monitor.output_path, monitor.csv_monitor.job_name) == ("", "DeepSpeedJobName")
    assert (monitor.wandb.group, monitor.wandb.team, monitor.wandb.project) == (None, None, "deepspeed")
    assert monitor.comet.samples_log_interval == 100 and monitor.comet.mode is None
    logger = cfg.comms_config.comms_logger
    assert not cfg.comms_config.comms_logger_enabled
    assert (logger.verbose, logger.prof_all, logger.prof_ops, logger.debug) == (False, True, (), False)
    prof = cfg.flops_profiler_config
    assert (prof.enabled, prof.recompute_fwd_factor, prof.profile_step, prof.module_depth, prof.top_modules,
            prof.detailed, prof.output_file) == (False, 0.0, 1, -1, 1, True, None)
    assert (cfg.eigenvalue_enabled, cfg.eigenvalue_verbose, cfg.eigenvalue_max_iter, cfg.eigenvalue_tol,
            cfg.eigenvalue_stability, cfg.eigenvalue_gas_boundary_resolution, cfg.eigenvalue_layer_name,
            cfg.eigenvalue_layer_num) == (False, False, 100, 1e-2, 1e-6, 1, "bert.encoder.layer", 0)


def test_any_enabled_backend_enables_the_monitor():
    for section in ("tensorboard", "csv_monitor", "wandb", "comet"):
        assert make(**{section: {"enabled": True}}).monitor_config.enabled


@pytest.mark.parametrize("sections, path", [
    ({
        "tensorboard": {
            "enabled": True,
            "job": "x"
        }
    }, "unknown config key 'tensorboard.job'"),
    ({
        "csv_monitor": {
            "output_path": 3
        }
    }, "csv_monitor.output_path"),
    ({
        "wandb": {
            "entity": "me"
        }
    }, "unknown config key 'wandb.entity'"),
    ({
        "comet": {
            "samples_log_interval": 0
        }
    }, "comet.samples_log_interval"),
    ({
        "comms_logger": {
            "enabled": True,
            "prof_op": []
        }
    }, "unknown config key 'comms_logger.prof_op'"),
    ({
        "comms_logger": {
            "prof_ops": [1]
        }
    }, "comms_logger.prof_ops"),
    ({
        "flops_profiler": {
            "profile_step": -1
        }
    }, "flops_profiler.profile_step"),
    ({
        "flops_profiler": {
            "output": "f"
        }
    }, "unknown config key 'flops_profiler.output'"),
    ({
        "eigenvalue": {
            "max_iter": 0
        }
    }, "eigenvalue.max_iter"),
    ({
        "eigenvalue": {
            "layer": "x"
        }
    }, "unknown config key 'eigenvalue.layer'"),
])
def test_bad_sections(sections, path):
    with pytest.raises(DeepSpeedConfigError, match=path.replace(".", r"\.")):
        make(**sections)
