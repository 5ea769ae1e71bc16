# SPDX-License-Identifier: Apache-2.0
"""What every node's ranks get: the exported prefixes, PYTHONPATH, and .deepspeed_env files."""

import os

import pytest

from deepspeed.launcher import environment, runner


def test_exported_prefixes_and_pythonpath():
    environ = {
        "PYTHONPATH": "/lib",
        "PYTHONHASHSEED": "0",
        "NCCL_DEBUG": "INFO",
        "UCX_TLS": "tcp",
        "MV2_X": "1",
        "MLFLOW_RUN": "r",
        "HOME": "/h",
        "CUDA_HOME": "/cuda",
        "XPU_Y": "2"
    }
    exports = environment.exported_environment(environ, "/job", {"NCCL_DEBUG": "WARN", "OWN": "v"}, ["XPU"])
    assert list(exports.items()) == [("MLFLOW_RUN", "r"), ("MV2_X", "1"), ("PYTHONHASHSEED", "0"),
                                     ("PYTHONPATH", "/job" + os.pathsep + "/lib"), ("UCX_TLS", "tcp"), ("XPU_Y", "2"),
                                     ("NCCL_DEBUG", "WARN"), ("OWN", "v")]
    assert environment.exported_environment({}, "/job")["PYTHONPATH"] == "/job"


def test_excluded_on_aisc():
    environ = {"AISC_JOB_NAME": "j", "NCCL_IB_HCA": "mlx5", "UCX_NET_DEVICES": "d", "NCCL_DEBUG": "INFO"}
    exports = environment.exported_environment(environ, "/job")
    assert "NCCL_IB_HCA" not in exports and "UCX_NET_DEVICES" not in exports and exports["NCCL_DEBUG"] == "INFO"


def test_upstream_constants():
    assert runner.DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
    assert {"MLFLOW", "PYTHON", "MV2", "UCX", "NCCL"} <= set(runner.EXPORT_ENVS)


def test_environment_files(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".deepspeed_env").write_text("# comment\n\nexport B=cwd=1\nC = spaced value \nD=\"quoted (x)\"\n")
    paths = environment.environment_file_paths(cwd=str(cwd), home=str(home), environ={})
    assert paths == [str(home / ".deepspeed_env"), str(cwd / ".deepspeed_env")]
    assert environment.read_environment_files(paths) == {
        "A": "home",
        "B": "cwd=1",
        "C": "spaced value",
        "D": "quoted (x)"
    }
    (cwd / ".deepspeed_env").write_text("NOT_AN_ASSIGNMENT\n")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        environment.read_environment_files(paths)


def test_ds_env_file_names_another_file(tmp_path):
    (tmp_path / "custom.env").write_text("X=1\n")
    paths = environment.environment_file_paths(cwd=str(tmp_path),
                                               home="/nonexistent",
                                               environ={"DS_ENV_FILE": "custom.env"})
    assert paths == ["/nonexistent/custom.env", str(tmp_path / "custom.env")]
    assert environment.read_environment_files(paths) == {"X": "1"}
    absolute = str(tmp_path / "custom.env")
    paths = environment.environment_file_paths(cwd="/else", home="/nonexistent", environ={"DS_ENV_FILE": absolute})
    assert paths == [absolute, absolute]
    assert environment.read_environment_files(paths) == {"X": "1"}  # read once
