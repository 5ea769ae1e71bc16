# SPDX-License-Identifier: Apache-2.0
"""Utilities: logging, access to full/local gradients, fp32 parameters and optimizer state, ZeRO-3 leaf modules."""

from deepspeed.utils import logging  # noqa: F401
from deepspeed.utils.logging import log_dist, log_dist_once, logger, set_log_level_from_string  # noqa: F401
from deepspeed.utils.comms_logging import get_caller_func  # noqa: F401
from deepspeed.utils.init_on_device import OnDevice  # noqa: F401
from deepspeed.utils.nvtx import instrument_w_nvtx  # noqa: F401
from deepspeed.utils.numa import get_numactl_cmd  # noqa: F401
from deepspeed.utils.module_utils import recursive_getattr, recursive_setattr  # noqa: F401
from deepspeed.utils.tensor_fragment import (  # noqa: F401
    safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state, safe_get_local_fp32_param,
    safe_get_local_grad, safe_get_local_optimizer_state, safe_set_full_fp32_param, safe_set_full_grad,
    safe_set_full_optimizer_state, safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized)
from deepspeed.utils.z3_leaf_module import (  # noqa: F401
    get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)
from deepspeed.runtime.dataloader import RepeatingLoader  # noqa: F401,E402
