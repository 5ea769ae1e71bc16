# SPDX-License-Identifier: Apache-2.0
"""Packaging for the ``deepspeed`` distribution.

The version comes from ``version.txt``; runtime and development requirements come from
``requirements/requirements.txt`` and ``requirements/requirements-dev.txt``; the ``tensorboard`` extra installs what
the TensorBoard monitor needs, the ``pydantic`` extra what ``DeepSpeedConfigModel`` needs.

Native ops: the sources in the top-level ``csrc/`` are copied into the built package as
``deepspeed/ops/csrc`` (an editable install reads the checkout's ``csrc/`` directly), so an op can be
built just in time on first use. ``DS_BUILD_OPS=1`` prebuilds every op that is compatible with the
build machine, ``DS_BUILD_<NAME>=1`` one op (``deepspeed/ops/op_builder``; this needs torch in the
build environment: ``pip install --no-build-isolation`` where pip isolates builds). The built package
also gets ``deepspeed/git_version_info_installed.py`` (version, git hash and branch, the torch the ops
were built with).
"""

import importlib.util
import os
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
NATIVE_SOURCE_SUFFIXES = (".cpp", ".cc", ".cu", ".cuh", ".h", ".hpp")
CSRC = os.path.join(ROOT, "csrc")


def read_text(relative_path):
    """Return the stripped contents of a file given relative to the repository root."""
    with open(os.path.join(ROOT, relative_path), encoding="utf-8") as handle:
        return handle.read().strip()


def read_requirements(relative_path):
    """Return the requirement lines of a requirements file, without comments or blank lines."""
    requirements = []
    for line in read_text(relative_path).splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirements.append(line)
    return requirements


def native_package_data(package_dir="deepspeed"):
    """Return the native sources under any ``csrc`` directory of the package, relative to ``package_dir``.

    An empty list when the package has no ``csrc`` directory.
    """
    found = []
    package_root = os.path.join(ROOT, package_dir)
    for dirpath, _, filenames in os.walk(package_root):
        if "csrc" not in os.path.relpath(dirpath, package_root).split(os.sep):
            continue
        for filename in filenames:
            if filename.endswith(NATIVE_SOURCE_SUFFIXES):
                found.append(os.path.relpath(os.path.join(dirpath, filename), package_root))
    return sorted(found)


def load_op_builder():
    """``deepspeed/ops/op_builder`` imported on its own (it needs only the standard library to import)."""
    folder = os.path.join(ROOT, "deepspeed", "ops", "op_builder")
    spec = importlib.util.spec_from_file_location("deepspeed_setup_op_builder",
                                                  os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def git_output(*args):
    try:
        out = subprocess.run(["git", "-C", ROOT] + list(args), capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    return out.stdout.strip() or "unknown"


def build_torch_info():
    """The facts of the torch the ops were built with (None when no op was prebuilt)."""
    if not EXTENSIONS:
        return None
    import torch

    def major_minor(text):
        return ".".join(str(text).split(".")[:2]) if text else "0.0"

    return {
        "version": major_minor(torch.__version__.split("+")[0]),
        "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
        "cuda_version": major_minor(torch.version.cuda),
        "nccl_version": "0.0",
        "hip_version": major_minor(getattr(torch.version, "hip", None)),
    }


class BuildPyWithNativeSources(build_py):
    """build_py, plus the native sources as ``deepspeed/ops/csrc`` and the install's version facts."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the checkout's csrc/ and git
        target = os.path.join(self.build_lib, "deepspeed", "ops", "csrc")
        for dirpath, _, filenames in os.walk(CSRC):
            for filename in filenames:
                if filename.endswith(NATIVE_SOURCE_SUFFIXES):
                    source = os.path.join(dirpath, filename)
                    destination = os.path.join(target, os.path.relpath(source, CSRC))
                    os.makedirs(os.path.dirname(destination), exist_ok=True)
                    shutil.copyfile(source, destination)
        info = os.path.join(self.build_lib, "deepspeed", "git_version_info_installed.py")
        with open(info, "w", encoding="utf-8") as handle:
            handle.write("# SPDX-License-Identifier: Apache-2.0\n# Written by setup.py when the package was built.\n")
            handle.write(f"version = {read_text('version.txt')!r}\n")
            handle.write(f"git_hash = {git_output('rev-parse', '--short', 'HEAD')!r}\n")
            handle.write(f"git_branch = {git_output('rev-parse', '--abbrev-ref', 'HEAD')!r}\n")
            handle.write(f"torch_info = {build_torch_info()!r}\n")


def import_build_torch():
    """torch, for prebuilding ops. pip builds in an isolated environment without the installed torch; the ops must
    be built against the torch they will run with, so the interpreter's own site-packages are appended to the
    path (after the isolated environment's, whose setuptools stays first) when torch is not found otherwise."""
    try:
        import torch
        return torch
    except ImportError:
        import site
        extra = [p for p in site.getsitepackages() + [site.getusersitepackages()] if p not in sys.path]
        sys.path.extend(extra)
        import torch
        print(f"deepspeed setup: building the ops against torch {torch.__version__} from {torch.__file__}")
        return torch


def native_extensions():
    """The op extensions ``DS_BUILD_OPS`` / ``DS_BUILD_<NAME>`` select, and the build_ext command for them."""
    op_builder = load_op_builder()
    requested = os.environ.get("DS_BUILD_OPS") == "1" or any(
        os.environ.get(cls.BUILD_VAR) == "1" for cls in op_builder.BUILT_BUILDERS)
    if not requested:
        return [], {}
    try:
        torch = import_build_torch()
        from torch.utils.cpp_extension import BuildExtension
    except ImportError as error:
        raise RuntimeError("DS_BUILD_OPS / DS_BUILD_<NAME> need torch in the build environment; install torch "
                           "first and build with pip install --no-build-isolation") from error
    builders, notes = op_builder.prebuild_selection(os.environ)
    for note in notes:
        print(f"deepspeed setup: {note}")
    if builders and not os.environ.get("TORCH_CUDA_ARCH_LIST") and any(b.with_cuda() for b in builders):
        if not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = op_builder.get_default_compute_capabilities()
    print(f"deepspeed setup: prebuilding {[b.NAME for b in builders] or 'no ops'}")
    return [b.builder() for b in builders], {"build_ext": BuildExtension.with_options(use_ninja=True)}


def long_description():
    """Return README.md when present, so an sdist without it still builds."""
    readme = os.path.join(ROOT, "README.md")
    if not os.path.isfile(readme):
        return ""
    with open(readme, encoding="utf-8") as handle:
        return handle.read()


EXTENSIONS, EXTENSION_COMMANDS = native_extensions()

setup(
    name="deepspeed",
    version=read_text("version.txt"),
    description="API-compatible DeepSpeed training runtime (ZeRO data parallelism) on top of PyTorch",
    long_description=long_description(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["deepspeed", "deepspeed.*"]),
    package_data={"deepspeed": native_package_data()},
    include_package_data=True,
    ext_modules=EXTENSIONS,
    cmdclass={
        "build_py": BuildPyWithNativeSources,
        **EXTENSION_COMMANDS
    },
    python_requires=">=3.9",
    install_requires=read_requirements("requirements/requirements.txt"),
    extras_require={
        "dev": read_requirements("requirements/requirements-dev.txt"),
        # the tensorboard monitor writes through torch.utils.tensorboard, which needs this package
        "tensorboard": ["tensorboard"],
        # deepspeed.runtime.config_utils.DeepSpeedConfigModel is upstream's pydantic base class of config sections
        "pydantic": ["pydantic>=2"],
    },
    entry_points={
        "console_scripts": [
            "deepspeed = deepspeed.launcher.runner:main",
            "ds = deepspeed.launcher.runner:main",
            "ds_report = deepspeed.env_report:cli_main",
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.9",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Operating System :: POSIX :: Linux",
    ],
)
