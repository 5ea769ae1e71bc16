# SPDX-License-Identifier: Apache-2.0
"""The op builder surface upstream's tests and tools import, the JIT build folder, prebuild selection, the
torch fallback where an op cannot be built, and ``ds_report``."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import deepspeed
from deepspeed.ops import grad_ops_native
from deepspeed.ops.native import forget_errors, load_error
from deepspeed.ops.op_builder import builder as builder_module
from deepspeed.ops.op_builder import ALL_OPS, BUILT_BUILDERS, CPUAdamBuilder, GradOpsBuilder, OpBuilder
from deepspeed.ops.op_builder import prebuild_selection
from deepspeed.runtime.zero.gradients import grad_ops

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# What upstream's unit tests and integrations import from deepspeed.ops.op_builder.
UPSTREAM_BUILDERS = [
    "AsyncIOBuilder", "CPUAdagradBuilder", "CPUAdamBuilder", "CPULionBuilder", "EvoformerAttnBuilder",
    "FPQuantizerBuilder", "FusedAdamBuilder", "FusedLambBuilder", "FusedLionBuilder", "GDSBuilder", "InferenceBuilder",
    "InferenceCoreBuilder", "QuantizerBuilder", "RaggedOpsBuilder", "RaggedUtilsBuilder", "RandomLTDBuilder",
    "SparseAttnBuilder", "SpatialInferenceBuilder", "StochasticTransformerBuilder", "TransformerBuilder",
    "NotImplementedBuilder", "DeepCompileBuilder", "OpBuilder", "CUDAOpBuilder", "TorchCPUOpBuilder"
]


def test_upstream_import_surface():
    import deepspeed.ops.op_builder as op_builder
    for name in UPSTREAM_BUILDERS:
        assert isinstance(getattr(op_builder, name), type), name
    assert callable(op_builder.get_default_compute_capabilities)
    compatible = deepspeed.ops.__compatible_ops__
    from deepspeed.ops import __compatible_ops__
    assert __compatible_ops__ is compatible
    assert set(compatible) == set(ALL_OPS) | {"deepspeed_not_implemented"}
    assert all(isinstance(v, bool) for v in compatible.values())
    # fused_adam is implemented in torch (deepspeed.ops.adam.fused_adam_op): compatible everywhere, as upstream's
    # tests expect on a CPU machine.
    assert compatible["fused_adam"] is True and compatible["deepspeed_not_implemented"] is False


def test_git_version_info():
    from deepspeed import git_version_info as info
    from deepspeed.git_version_info import compatible_ops, git_branch, git_hash, installed_ops, torch_info, version
    assert version == deepspeed.__version__
    assert isinstance(git_hash, str) and git_hash and isinstance(git_branch, str) and git_branch
    assert set(installed_ops) == set(ALL_OPS) and all(isinstance(v, bool) for v in installed_ops.values())
    assert compatible_ops is deepspeed.ops.__compatible_ops__
    assert set(torch_info) >= {"version", "bf16_support", "cuda_version", "nccl_version", "hip_version"}
    for key in ("version", "cuda_version", "nccl_version", "hip_version"):  # upstream's tests split them so
        assert re.fullmatch(r"\d+\.\d+", torch_info[key]), (key, torch_info[key])
    assert torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    assert info.accelerator_name in ("cuda", "cpu")
    with pytest.raises(AttributeError):
        info.no_such_fact


@pytest.mark.parametrize("name", list(ALL_OPS))
def test_every_builder_answers(name):
    builder = ALL_OPS[name]
    assert builder.NAME == name and builder.name == name
    assert builder.BUILD_VAR.startswith("DS_BUILD_")
    assert builder.absolute_name().startswith("deepspeed.ops.") and builder.absolute_name().endswith("_op")
    assert isinstance(builder.is_compatible(verbose=False), bool)
    assert isinstance(builder.sources(), list)
    from deepspeed.ops.op_builder.torch_ops import TORCH_BUILDERS
    if name in {b.NAME for b in TORCH_BUILDERS}:  # implemented in torch: always there, loads as a module
        assert builder.is_compatible() and builder.is_installed()
        assert builder.load().__name__ == builder.absolute_name()
    elif name not in {b.NAME for b in BUILT_BUILDERS}:
        assert not builder.is_compatible() and not builder.is_installed()
        with pytest.raises(NotImplementedError, match=name):
            builder.load()


def test_built_ops_sources_exist():
    for cls in BUILT_BUILDERS:
        builder = cls()
        for path in builder._absolute_sources() + builder._absolute_includes():
            assert os.path.exists(path), path


def test_cpu_adam_compatible_iff_compiler(monkeypatch):
    assert CPUAdamBuilder().is_compatible() == (builder_module.cxx_compiler() is not None)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    builder = CPUAdamBuilder()
    assert not builder.is_compatible()
    assert "no C++ compiler" in builder.incompatible_reason()


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the fallback of a torch without CUDA")
def test_grad_ops_fall_back_without_cuda():
    builder = GradOpsBuilder()
    assert not builder.is_compatible()
    assert "without CUDA" in builder.incompatible_reason()
    with pytest.raises(RuntimeError, match="cannot be built on this machine"):
        builder.jit_load(verbose=False)
    forget_errors()
    try:
        assert grad_ops_native.register(names=grad_ops_native.NAMES) == []
        assert "without CUDA" in load_error("grad_ops")
        for name in grad_ops_native.NAMES:
            assert grad_ops.implementation(name) is grad_ops._TORCH[name]
        # With the op missing the wrappers still honour the contract on CPU tensors (the torch path).
        out = torch.full((6, ), float("nan"))
        grad_ops_native.flatten_into([torch.ones(2), torch.ones(3)], out, 2.0, False)
        assert out.tolist() == [2.0] * 5 + [0.0]
    finally:
        forget_errors()
        grad_ops.reset()


def test_grad_ops_selection(monkeypatch):
    assert grad_ops_native.selected_names({"DS_NATIVE_GRAD_OPS": "1"}) == list(grad_ops_native.NAMES)
    assert grad_ops_native.selected_names({"DS_NATIVE_GRAD_OPS": "0"}) == []
    assert grad_ops_native.selected_names({}) == list(grad_ops_native.DEFAULT_NATIVE)
    assert grad_ops_native.register("cpu", names=grad_ops_native.NAMES) == []  # nothing for a CPU engine
    with pytest.raises(KeyError, match="no kernel"):
        grad_ops_native.register(names=["no_such_kernel"])


def test_jit_build_dir_is_keyed(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    adam, grads = CPUAdamBuilder(), GradOpsBuilder()
    folder = adam.jit_build_dir()
    assert folder.startswith(str(tmp_path / "ext" / "cpu_adam") + os.sep)
    leaf = os.path.basename(folder)
    assert sys.implementation.cache_tag in leaf and torch.__version__.split("+")[0] in leaf
    assert ("cpu" if torch.version.cuda is None else "cu") in leaf
    assert adam.jit_build_dir() == folder, "the key must be stable"
    assert os.path.dirname(grads.jit_build_dir()) != os.path.dirname(folder)

    # Another copy of the sources with one byte changed is another folder (and another lock).
    copy = tmp_path / "csrc"
    shutil.copytree(builder_module.csrc_root(), copy)
    monkeypatch.setattr(builder_module, "csrc_root", lambda: str(copy))
    same_content = adam.jit_build_dir()
    (copy / "adam" / "cpu_adam.cpp").write_text((copy / "adam" / "cpu_adam.cpp").read_text() + "\n// edited\n")
    assert adam.jit_build_dir() != same_content
    monkeypatch.setenv("DS_BUILD_PORTABLE", "1")  # other flags, another folder
    assert adam.jit_build_dir() != same_content

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert adam.jit_build_dir().startswith(str(tmp_path / "cache" / "deepspeed_ops" / "cpu_adam"))


def test_prebuild_selection():
    compiler = builder_module.cxx_compiler() is not None
    builders, notes = prebuild_selection({"DS_BUILD_OPS": "1"})
    assert ("cpu_adam" in [b.NAME for b in builders]) == compiler
    if torch.version.cuda is None:
        assert any("grad_ops" in note for note in notes)
    builders, _ = prebuild_selection({"DS_BUILD_OPS": "1", "DS_BUILD_CPU_ADAM": "0"})
    assert "cpu_adam" not in [b.NAME for b in builders]
    assert prebuild_selection({}) == ([], [])
    _, notes = prebuild_selection({"DS_BUILD_FUSED_ADAM": "1"})
    assert any("DS_BUILD_FUSED_ADAM=1 ignored" in note for note in notes)
    if torch.version.cuda is None:
        with pytest.raises(RuntimeError, match="DS_BUILD_GRAD_OPS=1"):
            prebuild_selection({"DS_BUILD_GRAD_OPS": "1"})


def test_loaded_ops_are_cached_per_process():
    assert isinstance(OpBuilder._loaded_ops, dict)
    if "cpu_adam" in OpBuilder._loaded_ops:
        assert CPUAdamBuilder().load() is OpBuilder._loaded_ops["cpu_adam"]


def test_ds_report_runs():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "deepspeed.env_report"],
                         cwd=REPO,
                         env=env,
                         capture_output=True,
                         text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for expected in ("DeepSpeed C++/CUDA extension op report", "op name", "installed", "compatible", "ninja",
                     "DeepSpeed general environment info", "torch version", "nvcc version", "c++ compiler"):
        assert expected in text, expected
    for name in ALL_OPS:
        assert re.search(rf"^{name} \.+ \[(YES|NO)\]", text, re.M), name
    assert "\033[" not in text, "colours only on a terminal"


def test_ds_report_options(capsys):
    from deepspeed.env_report import cli_main
    assert cli_main(["--hide_operator_status"]) == 0
    text = capsys.readouterr().out
    assert "op name" not in text and "torch version" in text
    assert cli_main(["--hide_errors_and_warnings"]) == 0
    assert "[WARNING]" not in capsys.readouterr().out


_JIT_LOAD = ("import sys; from deepspeed.ops.op_builder import CPUAdamBuilder; "
             "CPUAdamBuilder().jit_load(verbose=False); print('LOADED')")


def _jit_load_process():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", _JIT_LOAD],
                            cwd=REPO,
                            env=env,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            text=True)


def test_a_lock_left_by_a_killed_build_does_not_hang_later_loads():
    # torch's JIT builder serialises a build folder with the file `lock`; a build killed mid-compile leaves it, and
    # torch's loader then waits for it forever, even for a finished build. The load must remove it and go on.
    builder = CPUAdamBuilder()
    if builder.incompatible_reason() is not None:
        pytest.skip(builder.incompatible_reason())
    build_dir = builder.jit_build_dir()
    os.makedirs(build_dir, exist_ok=True)
    stale = os.path.join(build_dir, "lock")
    open(stale, "w").close()
    process = _jit_load_process()
    try:
        out, err = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 0 and "LOADED" in out, err[-2000:]
    assert "did not finish" in err
    assert not os.path.exists(stale)


def test_the_lock_of_a_build_in_progress_is_kept():
    # While another process builds (it holds the folder's flock and torch's `lock`), a load waits for it instead of
    # removing its lock; when that build ends, the load goes on.
    import fcntl
    import time
    builder = CPUAdamBuilder()
    if builder.incompatible_reason() is not None:
        pytest.skip(builder.incompatible_reason())
    build_dir = builder.jit_build_dir()
    os.makedirs(build_dir, exist_ok=True)
    live = os.path.join(build_dir, "lock")
    with open(build_dir.rstrip(os.sep) + ".build-lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        open(live, "w").close()
        process = _jit_load_process()
        try:
            time.sleep(8)
            assert process.poll() is None, "the load did not wait for the build in progress"
            assert os.path.exists(live)
        finally:
            os.remove(live)  # the build in progress ends: torch's lock goes, then the flock
            fcntl.flock(handle, fcntl.LOCK_UN)
    try:
        out, err = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 0 and "LOADED" in out, err[-2000:]
    assert "did not finish" not in err
