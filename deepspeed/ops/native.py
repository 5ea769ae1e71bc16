# SPDX-License-Identifier: Apache-2.0
"""Loading a native op with the torch implementation as the fallback.

:func:`load_op` returns the op's module, or None when it is neither prebuilt nor buildable here (no compiler, no
CUDA, a failed build); the caller then keeps its torch implementation, and one line in the log says so, once per
op and process. :func:`load_error` keeps the full reason (a compiler's output, say) for ``ds_report`` and
debugging.
"""

from deepspeed.utils.logging import logger

_errors = {}  # op name -> why it could not be loaded


def load_op(builder, purpose):
    """``builder.load()``, or None (with one note in the log) if the op cannot be loaded here.

    ``purpose`` names what the op accelerates, for the note ("DeepSpeedCPUAdam's step").
    """
    if builder.name in _errors:
        return None
    try:
        return builder.load(verbose=False)
    except Exception as error:  # a compiler error too: an op is an acceleration, never a requirement
        _errors[builder.name] = str(error)
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        logger.info(f"native op {builder.name} not available ({first_line}); {purpose} runs on torch")
        return None


def load_error(name):
    """Why the op ``name`` could not be loaded in this process, or None (loaded, or not tried)."""
    return _errors.get(name)


def forget_errors():
    """Let :func:`load_op` try again (tests change the environment between tries)."""
    _errors.clear()
