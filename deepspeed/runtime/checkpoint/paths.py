# SPDX-License-Identifier: Apache-2.0
"""Names of the files of a checkpoint, as upstream DeepSpeed lays them out.

::

    <dir>/latest                                            the tag of the newest complete checkpoint
    <dir>/<tag>/mp_rank_00_model_states.pt                  module, counters, scheduler, config, client state
    <dir>/<tag>/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt   ZeRO 1/2/3: data-parallel rank r's partition
    <dir>/<tag>/zero_pp_rank_{r}_mp_rank_00_model_states.pt          ZeRO 3 (instead of mp_rank_00_...): per rank

With tensor parallelism every tensor-parallel rank ``t`` writes its own set, ``mp_rank_{t:02d}``
in place of ``mp_rank_00`` (``r`` is then the rank within the data-parallel group).

Temporary files are written next to their final name (same directory, so the final
rename is atomic) and carry a ``.tmp-`` infix that no checkpoint file name has.
"""

import os
import uuid

LATEST_FILE = "latest"
MODEL_STATES_FILE = "mp_rank_00_model_states.pt"
ZERO3_MODEL_STATES_FILE = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
OPTIM_STATES_SUFFIX = "_optim_states.pt"
BF16_PREFIX = "bf16_"
RECOVERY_SCRIPT = "zero_to_fp32.py"
TEMP_INFIX = ".tmp-"


def default_tag(global_steps):
    """The tag ``save_checkpoint`` uses when none is given."""
    return f"global_step{global_steps}"


def tag_dir(root, tag):
    return os.path.join(root, str(tag))


def latest_path(root):
    return os.path.join(root, LATEST_FILE)


def model_states_name(mp_rank=0):
    """``mp_rank_{mp_rank:02d}_model_states.pt``."""
    return f"mp_rank_{int(mp_rank):02d}_model_states.pt"


def zero3_model_states_name(dp_rank, mp_rank=0):
    """``zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt``."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_{int(mp_rank):02d}_model_states.pt"


def model_states_path(root, tag, mp_rank=0):
    return os.path.join(tag_dir(root, tag), model_states_name(mp_rank))


def zero3_model_states_path(root, tag, dp_rank, mp_rank=0):
    """ZeRO stage 3: ``zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt`` (one per data-parallel rank)."""
    return os.path.join(tag_dir(root, tag), zero3_model_states_name(dp_rank, mp_rank))


def optim_states_name(dp_rank, bf16=False, mp_rank=0):
    """``[bf16_]zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt``."""
    return f"{BF16_PREFIX if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{int(mp_rank):02d}{OPTIM_STATES_SUFFIX}"


def optim_states_path(root, tag, dp_rank, bf16=False, mp_rank=0):
    return os.path.join(tag_dir(root, tag), optim_states_name(dp_rank, bf16, mp_rank))


def temp_path(path):
    """A unique temporary name in the same directory as ``path``."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}{TEMP_INFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def read_latest(root):
    """The tag named by ``<root>/latest`` (stripped), or None when that file does not exist."""
    try:
        with open(latest_path(root), "r") as handle:
            return handle.read().strip()
    except FileNotFoundError:
        return None
