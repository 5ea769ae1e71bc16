# SPDX-License-Identifier: Apache-2.0
"""The environment every rank of a multi-node job gets from the node that launched it.

Three sources, later ones winning (upstream's order):

1. the launching shell's variables whose names start with one of ``EXPORT_ENVS`` (plus the accelerator's own
   prefixes), except those ``EXCLUDE_ENVS`` holds back on clusters that set them per node;
2. ``PYTHONPATH`` with the launch directory first, so the script's own modules import on every node;
3. ``KEY=VALUE`` lines of ``.deepspeed_env`` in the home directory, then in the launch directory
   (``DS_ENV_FILE`` names another file, looked up the same way; an absolute path is read as it is).

Values are carried verbatim: the shell-based launchers quote them with ``shlex.quote`` (so spaces, parentheses
and ``$`` arrive as written), the MPI and Slurm launchers pass them as separate arguments or in their own
environment, never through a shell.
"""

import os
from collections import OrderedDict
from typing import Dict, List, Mapping, Optional, Sequence

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
DEEPSPEED_ENVIRONMENT_FILE_VAR = "DS_ENV_FILE"
# Upstream's exported prefixes; NCCL is upstream's CUDA accelerator's, kept here on every head node so a CPU-only
# login node still forwards the NCCL settings to the GPU nodes.
EXPORT_ENVS = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")
# On AISC compute every node sets these itself; forwarding the head's values would override them.
EXCLUDE_ENVS = {"AISC_JOB_NAME": ("NCCL_IB_HCA", "UCX_NET_DEVICES")}


def environment_file_paths(cwd: Optional[str] = None,
                           home: Optional[str] = None,
                           environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """The ``.deepspeed_env`` candidates in increasing priority: home, then the launch directory."""
    environ = os.environ if environ is None else environ
    name = environ.get(DEEPSPEED_ENVIRONMENT_FILE_VAR) or DEEPSPEED_ENVIRONMENT_NAME
    return [os.path.join(home or os.path.expanduser("~"), name), os.path.join(cwd or os.getcwd(), name)]


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def read_environment_files(paths: Sequence[str]) -> Dict[str, str]:
    """Read ``KEY=VALUE`` lines from the existing files among ``paths``; later files override earlier ones.

    Blank lines and ``#`` comments are skipped, a leading ``export`` is allowed, the value is everything after the
    first ``=`` (stripped; one pair of enclosing quotes removed). Each file is read once even if listed twice
    (home == launch directory). A line without ``=`` raises ValueError naming the file and line.
    """
    values: Dict[str, str] = {}
    seen = set()
    for path in paths:
        real = os.path.realpath(path)
        if real in seen or not os.path.isfile(path):
            continue
        seen.add(real)
        with open(path, encoding="utf-8") as handle:
            for number, raw_line in enumerate(handle, start=1):
                line = raw_line.strip()
                if not line or line.startswith("#"):
                    continue
                if line.startswith("export "):
                    line = line[len("export "):].strip()
                key, sep, value = line.partition("=")
                if not sep or not key.strip():
                    raise ValueError(f"{path}:{number}: expected KEY=VALUE, got {raw_line.strip()!r}")
                values[key.strip()] = _unquote(value.strip())
    return values


def prepend_launch_dir(pythonpath: Optional[str], launch_dir: str) -> str:
    """``PYTHONPATH`` with ``launch_dir`` first (as upstream)."""
    return launch_dir + (os.pathsep + pythonpath if pythonpath else "")


def exported_environment(environ, launch_dir, file_values=None, extra_prefixes=()) -> "OrderedDict[str, str]":
    """The variables a multi-node launcher sets on every node, in the order they are applied.

    ``environ`` is the launching shell's environment (a mapping), ``launch_dir`` the directory put first on
    ``PYTHONPATH``, ``file_values`` what ``read_environment_files`` found, ``extra_prefixes`` the accelerator's.
    """
    prefixes = tuple(EXPORT_ENVS) + tuple(p for p in extra_prefixes if p not in EXPORT_ENVS)
    held_back = set()
    for marker, names in EXCLUDE_ENVS.items():
        if marker in environ:
            held_back.update(names)
    source = dict(environ)
    source["PYTHONPATH"] = prepend_launch_dir(environ.get("PYTHONPATH"), launch_dir)
    exports: "OrderedDict[str, str]" = OrderedDict()
    for key in sorted(source):
        if key.startswith(prefixes) and key not in held_back:
            exports[key] = source[key]
    for key, value in (file_values or {}).items():
        exports.pop(key, None)
        exports[key] = value
    return exports
