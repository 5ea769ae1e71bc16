# SPDX-License-Identifier: Apache-2.0
"""``ds_report``: the environment and the native ops of this install, laid out as upstream's report.

First the op table (is each op prebuilt into this install, can it be built here, can it be built just in time
now, i.e. is ninja there too), with the reason printed above each op that cannot be built; then torch, CUDA,
compiler and install facts. ``python -m deepspeed.env_report`` runs it too.
"""

import argparse
import os
import sys

GREEN = "\033[92m"
RED = "\033[91m"
YELLOW = "\033[93m"
END = "\033[0m"
OKAY = f"{GREEN}[OKAY]{END}"
YES = f"{GREEN}[YES]{END}"
NO = f"{YELLOW}[NO]{END}"
FAIL = f"{RED}[FAIL]{END}"
WARNING = f"{YELLOW}[WARNING]{END}"
_COLOR_LEN = len(GREEN) + len(END)
_NAME_WIDTH = 23
_COLUMN_WIDTH = 11


def _dots(text, width):
    return text + " " + "." * max(width - len(text) - 1, 2) + " "


def _marker(flag, good="YES", bad="NO"):
    """``[YES]`` in green or ``[NO]`` in yellow (plain when colours are off)."""
    return f"{GREEN}[{good}]{END}" if flag else f"{YELLOW}[{bad}]{END}"


def _op_row(name, installed, compatible, jit):
    width = _COLUMN_WIDTH + _COLOR_LEN
    return (_dots(name, _NAME_WIDTH) + _dots(_marker(installed), width) + _dots(_marker(compatible, "OKAY"), width) +
            _marker(jit, "OKAY"))


def op_report(verbose=True):
    """Print the op table. ``verbose`` prints why each op that cannot be built cannot."""
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import ALL_OPS, BUILT_BUILDERS
    from deepspeed.ops.op_builder.torch_ops import TORCH_BUILDERS
    from deepspeed.ops.op_builder.builder import ninja_available

    header = ["op name", "installed", "compatible", "jit"]
    rule = "-" * (_NAME_WIDTH + 3 * _COLUMN_WIDTH + 6)
    print(rule)
    print("DeepSpeed C++/CUDA extension op report")
    print(rule)
    print("NOTE: Ops not installed will be just-in-time (JIT) compiled at\n"
          "      runtime when first used. 'compatible' means this machine has\n"
          "      what the op needs (compiler, CUDA); 'jit' that ninja is there\n"
          "      too, so the op can be built now. Where an op cannot be built,\n"
          "      its torch implementation runs instead.")
    print(rule)
    print("JIT compiled ops requires ninja")
    ninja = ninja_available()
    print(_dots("ninja", _NAME_WIDTH) + (OKAY if ninja else FAIL))
    print(rule)
    print(
        _dots(header[0], _NAME_WIDTH) + _dots(header[1], _COLUMN_WIDTH) + _dots(header[2], _COLUMN_WIDTH) + header[3])
    print(rule)
    built = [builder.NAME for builder in BUILT_BUILDERS]
    for name in built:
        compatible = ALL_OPS[name].is_compatible(verbose=verbose)
        print(_op_row(name, installed_ops.get(name, False), compatible, compatible and ninja))
    print(rule)
    print("Upstream ops implemented in torch here (nothing to build):")
    in_torch = [builder.NAME for builder in TORCH_BUILDERS]
    for name in in_torch:
        print(_op_row(name, True, True, False))
    print(rule)
    print("Upstream ops this package does not build (what replaces each one\n"
          "is listed in docs/compatibility.md):")
    for name in ALL_OPS:
        if name not in built and name not in in_torch:
            print(_op_row(name, False, False, False))
    print(rule)


def _shm_size():
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    size = stat.f_frsize * stat.f_blocks
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{size:.2f} {unit}" if unit != "B" else f"{size} B"
        size /= 1024


def debug_report():
    """Print torch, CUDA, compiler and install facts."""
    import torch

    import deepspeed
    from deepspeed.git_version_info import git_branch, git_hash, torch_info
    from deepspeed.ops.op_builder.builder import cuda_home, cxx_version, jit_cache_root, nvcc_version

    cuda_version = torch.version.cuda
    rows = [
        ("torch install path", [os.path.dirname(torch.__file__)]),
        ("torch version", torch.__version__),
        ("deepspeed install path", [os.path.dirname(deepspeed.__file__)]),
        ("deepspeed info", f"{deepspeed.__version__}, {git_hash}, {git_branch}"),
        ("torch cuda version", cuda_version),
        ("torch hip version", getattr(torch.version, "hip", None)),
        ("nvcc version", nvcc_version()),
        ("cuda home", cuda_home()),
        ("c++ compiler", cxx_version()),
        ("deepspeed wheel compiled w.", f"torch {torch_info['version']}, cuda {torch_info['cuda_version']}"),
        ("jit build cache", jit_cache_root()),
        ("shared memory (/dev/shm) size", _shm_size()),
    ]
    print("DeepSpeed general environment info:")
    for name, value in rows:
        print(_dots(name, 33) + str(value))


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description="Report the environment and the native ops of DeepSpeed")
    parser.add_argument("--hide_operator_status",
                        action="store_true",
                        help="leave out the op table (which also checks each op's requirements)")
    parser.add_argument("--hide_errors_and_warnings", action="store_true", help="leave out why an op cannot be built")
    return parser.parse_args(argv)


def main(hide_operator_status=False, hide_errors_and_warnings=False):
    if not hide_operator_status:
        op_report(verbose=not hide_errors_and_warnings)
    debug_report()


def cli_main(argv=None):
    """The ``ds_report`` console script."""
    args = parse_arguments(argv)
    if not sys.stdout.isatty():
        _strip_colors()
    main(hide_operator_status=args.hide_operator_status, hide_errors_and_warnings=args.hide_errors_and_warnings)
    return 0


def _strip_colors():
    """Plain markers when the output is not a terminal (a log file, a pipe)."""
    global GREEN, RED, YELLOW, END, OKAY, YES, NO, FAIL, WARNING, _COLOR_LEN
    GREEN = RED = YELLOW = END = ""
    OKAY, YES, NO, FAIL, WARNING = "[OKAY]", "[YES]", "[NO]", "[FAIL]", "[WARNING]"
    _COLOR_LEN = 0


if __name__ == "__main__":
    sys.exit(cli_main())
