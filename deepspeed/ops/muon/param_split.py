# SPDX-License-Identifier: Apache-2.0
"""Which parameters Muon steps, and the param groups of ``"optimizer": {"type": "Muon"}`` (upstream's rule and keys).

A parameter goes to Muon when its layer shape has two or more dimensions and its name contains neither ``embed`` nor
``lm_head`` (case-insensitive); everything else goes to the auxiliary Adam. The layer shape of a ZeRO-3 parameter
built under ``zero.Init`` is its ``ds_shape`` (its data is a flat shard or empty there), so ``zero.Init`` changes
nothing. The decision is kept on the parameter as ``param.use_muon``; a parameter that already carries
``use_muon`` when ``deepspeed.initialize`` runs keeps it (a user's marking is honoured; a ``True`` mark on a
parameter with fewer than two dimensions raises).

Config keys (``optimizer.params``): ``lr`` (both halves), ``muon_lr`` / ``adam_lr`` (one half), ``momentum``,
``weight_decay``, ``ns_method``, ``ns_steps``, ``nesterov`` (Muon half); ``betas``, ``eps`` (Adam half);
``adam_w_mode`` (default true: AdamW) and ``torch_adam`` (torch's AdamW/Adam as the Adam). A param group passed
in ``model_parameters`` keeps its own settings: each group is split into its Muon and Adam halves, and a setting
resolves as the config's shared value, then ``muon_lr``/``adam_lr``, then the group's own.
"""

MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method", "ns_steps", "nesterov")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
CONFIG_ONLY_KEYS = ("muon_lr", "adam_lr", "adam_w_mode", "torch_adam", "per_head_muon")
MUON_CONFIG_KEYS = frozenset(MUON_KEYS + ADAM_KEYS + CONFIG_ONLY_KEYS)
_ADAM_ONLY_GROUP_KEYS = ("amsgrad", "bias_correction")


def layer_shape(param):
    """The parameter's shape as a layer (``ds_shape`` for a ZeRO-3 partitioned parameter)."""
    ds_shape = getattr(param, "ds_shape", None)
    return tuple(param.shape) if ds_shape is None else tuple(ds_shape)


def is_muon_param(name, param):
    """Upstream's split: a matrix (ndim >= 2) that is not an embedding or the LM head."""
    lowered = name.lower()
    return len(layer_shape(param)) >= 2 and "embed" not in lowered and "lm_head" not in lowered


def tag_muon_params(model):
    """Set ``param.use_muon`` on every parameter of ``model`` that does not carry it yet (see the module docstring)."""
    for name, param in model.named_parameters():
        if not hasattr(param, "use_muon"):
            param.use_muon = is_muon_param(name, param)


def check_muon_config(optimizer_params):
    """ValueError for a key Muon does not take, NotImplementedError for ``per_head_muon``."""
    unknown = sorted(set(optimizer_params) - MUON_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"optimizer.params {unknown} are not keys of the Muon optimizer; it takes "
                         f"{sorted(MUON_CONFIG_KEYS - {'per_head_muon'})}")
    if optimizer_params.get("per_head_muon", False):
        raise NotImplementedError("optimizer.params.per_head_muon (per-attention-head Newton-Schulz) is not supported "
                                  "by this DeepSpeed runtime; see docs/compatibility.md")


def _half_settings(optimizer_params, keys, lr_key):
    settings = {key: optimizer_params[key] for key in keys if key in optimizer_params}
    if lr_key in optimizer_params:
        settings["lr"] = optimizer_params[lr_key]
    return settings


def muon_param_groups(params, optimizer_params):
    """Split ``params`` (tensors or param-group dicts) into Muon and Adam groups (``use_muon`` True/False).

    Group names are upstream's: ``muon-params`` / ``adam-params`` for one incoming group, prefixed by the group's
    ``name`` (or ``group<i>``) for several. Raises ValueError for a trainable parameter without ``use_muon``.
    """
    groups, loose = [], []
    for item in params:
        (groups if isinstance(item, dict) else loose).append(item)
    if loose or not groups:
        groups.append({"params": loose})
    halves = ((True, "muon", MUON_KEYS, _half_settings(optimizer_params, MUON_KEYS, "muon_lr")),
              (False, "adam", ADAM_KEYS + _ADAM_ONLY_GROUP_KEYS, _half_settings(optimizer_params, ADAM_KEYS,
                                                                                "adam_lr")))
    out = []
    for index, group in enumerate(groups):
        trainable = [p for p in group["params"] if p.requires_grad]
        missing = [p for p in trainable if not hasattr(p, "use_muon")]
        if missing:
            raise ValueError(f"the Muon optimizer needs every parameter marked with use_muon, and {len(missing)} "
                             "are not: model_parameters holds parameters the model does not. Set "
                             "`param.use_muon = True / False` on them, or pass them as part of the model.")
        for p in trainable:
            if p.use_muon and len(layer_shape(p)) < 2:
                raise ValueError(f"a parameter of shape {layer_shape(p)} is marked use_muon=True; Muon steps "
                                 "matrices (ndim >= 2) only")
        overrides = {k: v for k, v in group.items() if k != "params"}
        for use_muon, label, keys, defaults in halves:
            half = [p for p in trainable if bool(p.use_muon) is use_muon]
            if not half:
                continue
            settings = dict(defaults)
            settings.update({k: v for k, v in overrides.items() if k in keys})
            prefix = overrides.get("name") or (f"group{index}" if len(groups) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            out.append(dict(params=half, use_muon=use_muon, name=name, **settings))
    return out
