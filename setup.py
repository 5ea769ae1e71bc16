# SPDX-License-Identifier: Apache-2.0
"""Packaging for the ``deepspeed`` distribution.

The version comes from ``version.txt``; runtime and development requirements come from
``requirements/requirements.txt`` and ``requirements/requirements-dev.txt``; the ``tensorboard`` extra installs what
the TensorBoard monitor needs. Native sources kept in a
``csrc`` directory inside the package are shipped as package data. Nothing is compiled at install time.
"""

import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
NATIVE_SOURCE_SUFFIXES = (".cpp", ".cc", ".cu", ".cuh", ".h", ".hpp")


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


def long_description():
    """Return README.md when present, so an sdist without it still builds."""
    readme = os.path.join(ROOT, "README.md")
    if not os.path.isfile(readme):
        return ""
    with open(readme, encoding="utf-8") as handle:
        return handle.read()


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
    python_requires=">=3.9",
    install_requires=read_requirements("requirements/requirements.txt"),
    extras_require={
        "dev": read_requirements("requirements/requirements-dev.txt"),
        # the tensorboard monitor writes through torch.utils.tensorboard, which needs this package
        "tensorboard": ["tensorboard"],
    },
    entry_points={
        "console_scripts": [
            "deepspeed = deepspeed.launcher.runner:main",
            "ds = deepspeed.launcher.runner:main",
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
