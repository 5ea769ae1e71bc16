# SPDX-License-Identifier: Apache-2.0
"""Master weights and optimizer state in a 16-bit dtype (``bf16.bf16_master_weights_and_grads``,
``bf16.bf16_optimizer_states``, ``fp16.fp16_master_weights_and_grads``), ZeRO stages 1-3.

By default a ZeRO stage keeps an fp32 master partition of the 16-bit model and the optimizer's state in the
masters' dtype: 4 + 8 bytes a parameter with Adam. With these keys the masters are kept in the model's 16-bit
dtype (2 bytes) and, with ``bf16_optimizer_states``, the optimizer state too (4 bytes for Adam's two moments):
about 6 bytes a parameter less. The gradients ("and_grads") are accumulated, reduced and stepped in that dtype too
(2 bytes less again), unless ``data_types.grad_accum_dtype`` names another (then the window gradient is rounded to
the masters' dtype for each step). The step is the one a plain torch optimizer takes on 16-bit parameters: the
optimizer updates the 16-bit masters in place.

Upstream's rules, checked when the engine is built (every rank, the same answer):

* the three keys need ZeRO stage 1, 2 or 3 (``config.py``); the fp16 and bf16 master keys exclude each other; a
  key of a precision that is not enabled (bf16 masters without ``bf16.enabled``) is refused here;
* ``bf16_optimizer_states`` needs ``bf16_master_weights_and_grads``;
* fp16 masters, and bf16 masters with fp32 optimizer state, need optimizer offload with ``DeepSpeedCPUAdam``
  (it keeps float32 moments for 16-bit parameters); bf16 optimizer state with optimizer offload needs
  ``DeepSpeedCPUAdam(fp32_optimizer_states=False)`` (the engine builds it so from an ``optimizer`` section);
* without offload (bf16 masters and state on the device) any optimizer whose state follows its parameters'
  dtype is accepted; one that keeps float32 moments (``fp32_optimizer_states=True``) is refused.

Not supported here, refused by name: ZenFlow, ``super_offload``, NVMe optimizer offload and partial offload
(``offload_optimizer.ratio`` < 1) with 16-bit masters (their steps read float32 masters).
"""

import torch

from deepspeed.runtime.config_utils import DeepSpeedConfigError


def master_dtype(cfg):
    """The masters' dtype a parsed DeepSpeed config asks for (float32 unless a master key is on); raises
    DeepSpeedConfigError or NotImplementedError for a combination that is refused (see the module docstring)."""
    fp16_masters = bool(cfg.fp16_master_weights_and_grads)
    bf16_masters = bool(cfg.bf16_master_weights_and_grads)
    bf16 = getattr(cfg, "_bf16_section", "bf16")
    if not (fp16_masters or bf16_masters):
        return torch.float32
    if fp16_masters and bf16_masters:
        raise DeepSpeedConfigError(f"config keys 'fp16.fp16_master_weights_and_grads' and "
                                   f"'{bf16}.bf16_master_weights_and_grads' exclude each other; set at most one")
    key = "fp16.fp16_master_weights_and_grads" if fp16_masters else f"{bf16}.bf16_master_weights_and_grads"
    enabled = cfg.fp16_enabled if fp16_masters else cfg.bfloat16_enabled
    if not enabled:
        section = "fp16" if fp16_masters else bf16
        raise DeepSpeedConfigError(f"config key '{key}' needs '{section}.enabled' true (the masters take the "
                                   "model's 16-bit dtype)")
    zero = cfg.zero_config
    device = str(getattr(zero.offload_optimizer_device, "value", zero.offload_optimizer_device))
    offloaded = device in ("cpu", "nvme")
    states_16bit = bool(cfg.bf16_optimizer_states)
    if (fp16_masters or not states_16bit) and not offloaded:
        need = "" if fp16_masters else f" unless '{bf16}.bf16_optimizer_states' is true as well"
        raise DeepSpeedConfigError(f"config key '{key}' needs optimizer offload ('zero_optimization.offload_optimizer."
                                   f"device' 'cpu') with DeepSpeedCPUAdam{need}, as upstream requires")
    refused = ((zero.zenflow is not None, "ZenFlow ('zero_optimization.zenflow')"),
               (offloaded and bool(zero.offload_optimizer.super_offload),
                "'offload_optimizer.super_offload'"), (device == "nvme", "'offload_optimizer.device' 'nvme'"),
               (offloaded and float(zero.offload_optimizer.ratio) < 1.0, "'offload_optimizer.ratio' < 1"))
    for bad, what in refused:
        if bad:
            raise NotImplementedError(f"config key '{key}' (16-bit master weights) is not supported with {what}; "
                                      "see docs/compatibility.md")
    return torch.float16 if fp16_masters else torch.bfloat16


def cpu_adam_params(cfg, optimizer_name, optimizer_params):
    """The ``optimizer.params`` the engine builds an offloaded Adam with: ``bf16_optimizer_states`` keeps its
    moments in bf16 (``fp32_optimizer_states`` false, overriding the params, as upstream does)."""
    params = dict(optimizer_params or {})
    if (cfg.bf16_optimizer_states and isinstance(optimizer_name, str) and optimizer_name.lower() in ("adam", "adamw")
            and not params.get("torch_adam", False)):
        params["fp32_optimizer_states"] = False
    return params


def check_optimizer(config, optimizer):
    """Upstream's rules on the inner optimizer for 16-bit masters (``config``: a StageConfig); raises
    DeepSpeedConfigError. A no-op for float32 masters."""
    if config.master_dtype == torch.float32:
        return
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    fp32_states = bool(getattr(optimizer, "fp32_optimizer_states", False))
    name = type(optimizer).__name__
    if config.offload_optimizer:
        if type(optimizer) is not DeepSpeedCPUAdam:
            raise DeepSpeedConfigError(
                f"16-bit master weights with optimizer offload need DeepSpeedCPUAdam, got {name}")
        if config.states_16bit and fp32_states:
            raise DeepSpeedConfigError("'bf16.bf16_optimizer_states' with optimizer offload needs DeepSpeedCPUAdam "
                                       "constructed with fp32_optimizer_states=False (moments kept in bf16)")
    elif fp32_states:
        raise DeepSpeedConfigError(f"'bf16.bf16_optimizer_states' needs an optimizer whose state takes the "
                                   f"parameters' dtype; {name} has fp32_optimizer_states=True")
