# SPDX-License-Identifier: Apache-2.0
"""Config keys of upstream's surface that this runtime parses but does not act on: one table, checked per config.

Every key or section upstream DeepSpeed acts on is either honoured here or listed below, so that a config never
asks for something the run silently does without:

* :data:`NOT_BUILT`: the feature changes what training computes (quantized or compressed training, ...). A
  config that asks for it raises ``NotImplementedError`` naming the key.
  ``DeepSpeedConfig`` runs the check when it is built, which ``deepspeed.initialize`` does on every rank before
  any collective, so every rank raises the same error and nothing hangs.
* :data:`NO_EFFECT`: the key only tunes speed or memory (the optimizer still sees the exact gradient), or upstream
  itself ignores it without a companion feature. A config that sets it is accepted with one warning saying so.

A row names the key as the user writes it (a dotted path), a predicate on its value (is the feature asked for?),
the feature, and what to do instead. When a feature is built, its row goes (and its row in
``tests/unit/runtime/test_config_audit.py``); nothing else refers to the rows.
"""

from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..config_utils import logger

DOCS = "see docs/compatibility.md"


@dataclass(frozen=True)
class Row:
    key: str  # dotted path into the config dict
    asks: Callable[[Any], bool]  # the value at ``key`` (when present) asks for the feature
    feature: str
    instead: str = ""


def _enabled(value) -> bool:
    """A switch as upstream reads one (pydantic's lax bools: ``"true"``, ``1`` ... count as on)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on", "t", "y")
    return bool(value)


def _section_enabled(value) -> bool:
    return isinstance(value, dict) and _enabled(value.get("enabled", False))


def _given(value) -> bool:
    """A section with anything in it."""
    return value not in (None, {}, [], False)


def _any_enabled(section) -> bool:
    """Any ``enabled`` switch on, at any depth (the compression library nests one per technique)."""
    if isinstance(section, dict):
        return any((key == "enabled" and _enabled(value)) or _any_enabled(value) for key, value in section.items())
    if isinstance(section, list):
        return any(_any_enabled(item) for item in section)
    return False


def _quantized_weights(section) -> bool:
    return isinstance(section, dict) and any(
        _given(section.get(k)) for k in ("quantized_initialization", "post_init_quant"))


NOT_BUILT = (
    # features upstream has, or had, that change what training computes
    Row("amp", _section_enabled, "NVIDIA Apex AMP (amp.enabled; upstream 0.19 removed it too)",
        "use 'fp16', 'bf16' or 'torch_autocast'"),
    Row("hybrid_engine", _section_enabled, "the hybrid engine (hybrid_engine.enabled: DeepSpeedHybridEngine)"),
    Row("quantize_training", _section_enabled, "Mixture-of-Quantization training (quantize_training.enabled)"),
    Row("compression_training", _any_enabled, "the compression library (compression_training; deepspeed.compression)",
        "the model would train unquantized and unpruned"),
    Row("weight_quantization", _quantized_weights,
        "quantized weights (weight_quantization.quantized_initialization / post_init_quant)"),
    Row("autotuning", _section_enabled, "the autotuner (autotuning.enabled)"),
    Row("data_efficiency", _section_enabled, "data efficiency (data_efficiency.enabled: curriculum sampling, "
        "dynamic batching, random-LTD)"),
    Row("curriculum_learning", _section_enabled, "legacy curriculum learning (curriculum_learning.enabled)"),
    Row("progressive_layer_drop", _section_enabled, "progressive layer drop (progressive_layer_drop.enabled)"),
    Row("nebula", _section_enabled, "Nebula checkpointing (nebula.enabled)",
        "checkpoints would be written locally with torch.save"),
    Row("datastates_ckpt", lambda value: value is not False, "DataStates asynchronous checkpoints (datastates_ckpt; "
        "upstream turns them on for any value but false)", "use checkpoint.writer with decoupled=true"),
    Row("checkpoint.writer.type", lambda value: str(value).strip().upper() == "MOCK",
        "the mock checkpoint writer (checkpoint.writer.type 'mock' writes files without their bytes)",
        "its checkpoints would not load; use 'fast' or 'python'"),
    Row("use_data_before_expert_parallelism", _enabled, "the data-before-expert-parallel rank layout "
        "(use_data_before_expert_parallelism)", "expert groups would be laid out expert-parallel first"),
    Row("checkpoint.use_node_local_storage", _enabled, "node-local checkpoint storage "
        "(checkpoint.use_node_local_storage)", "only global rank 0 writes the shared files"),
    Row("sparse_gradients", _enabled, "sparse compression of dense embedding gradients (sparse_gradients)",
        "remove the key: upstream 0.19 refuses it too, and an nn.Embedding(sparse=True) needs no flag"),
    Row("graph_harvesting", _enabled, "graph harvesting (graph_harvesting)",
        "remove the key (upstream 0.19 refuses it too)"),
    Row("sparse_attention", _given, "the sparse attention ops (the 'sparse_attention' section)",
        "remove the section (upstream 0.19 refuses it too)"),
)

NO_EFFECT = (
    Row("datastates", _given, "the 'datastates' section",
        "checkpoints are written with torch.save, as upstream writes them without the datastates package"),
    Row("dump_state", _enabled, "dump_state", "the engine's state is not printed (DeepSpeedConfig.print() shows the "
        "configuration)"),
)


def _value_at(param_dict, path):
    """``(True, value)`` at dotted ``path`` of the config, ``(False, None)`` when absent."""
    node = param_dict
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def refusal(param_dict, rows=NOT_BUILT) -> Optional[str]:
    """The message of the first row of ``rows`` the config asks for, or None."""
    for row in rows:
        found, value = _value_at(param_dict, row.key)
        if found and row.asks(value):
            advice = f"; {row.instead}" if row.instead else ""
            return (f"config key '{row.key}' ({value!r}) asks for {row.feature}, which is not built in this runtime"
                    f"{advice}; {DOCS}")
    return None


def check_param_dtype(config) -> None:
    """``data_types.param_dtype``, when given, must be the dtype the fp16/bf16 switches give the model (fp32 when
    neither is on), as upstream asserts: every precision path here follows the switches. One rule with the engine's
    ``_assert_valid_mixed_precision_config`` (``precision/module_cast.py``): the error is a ``DeepSpeedConfigError``
    and an ``AssertionError``."""
    from deepspeed.runtime.precision.module_cast import check_param_dtype as check
    check(config.param_dtype, config.fp16_enabled, config.bfloat16_enabled)


def audit_config(config) -> None:
    """Raise ``NotImplementedError`` for a config that asks for a feature of :data:`NOT_BUILT`; warn once (on global
    rank 0) for each key of :data:`NO_EFFECT` it sets. ``config`` is a ``DeepSpeedConfig`` being built."""
    param_dict = config._param_dict
    message = refusal(param_dict)
    if message is not None:
        raise NotImplementedError(message)
    check_param_dtype(config)
    if getattr(config, "global_rank", 0) != 0:
        return
    for row in NO_EFFECT:
        found, value = _value_at(param_dict, row.key)
        if found and row.asks(value):
            logger.warning(f"config key '{row.key}' ({value!r}) has no effect in this runtime: {row.instead}")
