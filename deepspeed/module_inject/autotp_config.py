# SPDX-License-Identifier: Apache-2.0
"""Sharding rules given as data: ``tensor_parallel.partition_config`` and the built-in presets (upstream's names).

A :class:`TPLayerSpec` says how the layers whose weight's name matches one of its ``patterns``
(regular expressions, ``re.match`` on the parameter name, e.g. ``model.layers.0.mlp.down_proj.weight``)
are cut: ``row``, ``column`` (``gather_output`` for a head whose output every rank needs) or
``skip`` (left whole; ``grad_allreduce`` says its gradient is a per-rank share to be summed,
which the runtime also finds by itself). ``shape`` and ``partition_dim`` describe fused
weights: at ``partition_dim`` an int ``n`` (``n`` equal sub-parameters, ``[gate; up]``) or a
list of sizes (``[q; k; v]`` of a GQA model), -1 elsewhere. ``model_types`` restricts a spec
to models whose ``config.model_type`` is listed.

:class:`AutoTPConfig` holds the specs (the first matching spec wins); :class:`AutoTPPresets`
has upstream's presets (``llama``, ``llama_gqa``, ``bloom``, ``chatglm``, ``mixtral``,
``deepseek_v2``, ``qwen2``, ``phi3``); with ``use_default_specs`` a partition_config's specs
are put in front of the preset's (:func:`merge_autotp_configs`).
"""

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional, Tuple, Union


class PartitionType(Enum):
    COLUMN = "column"
    ROW = "row"
    SKIP = "skip"


def _tupled(shape):
    if isinstance(shape, (list, tuple)):
        return tuple(_tupled(s) if isinstance(s, (list, tuple)) else s for s in shape)
    return shape


@dataclass
class TPLayerSpec:
    """One sharding rule (module docstring)."""
    patterns: List[str]
    partition_type: PartitionType = PartitionType.COLUMN
    shape: Optional[Tuple[Union[int, Tuple[int, ...]], ...]] = None
    partition_dim: Optional[int] = None
    model_types: Optional[List[str]] = None
    gather_output: bool = False
    grad_allreduce: bool = False

    def __post_init__(self):
        if isinstance(self.patterns, str):
            self.patterns = [self.patterns]
        if not self.patterns or not all(isinstance(p, str) and p for p in self.patterns):
            raise ValueError(f"AutoTP: a layer spec needs a non-empty list of regular expressions as 'patterns', got "
                             f"{self.patterns!r}")
        for pattern in self.patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(
                    f"AutoTP: layer spec pattern {pattern!r} is not a regular expression: {err}") from None
        if isinstance(self.partition_type, str):
            try:
                self.partition_type = PartitionType(self.partition_type.lower())
            except ValueError:
                raise ValueError(f"AutoTP: partition_type must be one of 'row', 'column', 'skip', got "
                                 f"{self.partition_type!r}") from None
        if self.shape is not None:
            self.shape = _tupled(self.shape)
            self._check_shape()
        if self.gather_output and self.partition_type != PartitionType.COLUMN:
            raise ValueError(
                f"AutoTP: gather_output applies to column-parallel layers only (patterns {self.patterns})")
        if self.grad_allreduce and self.partition_type != PartitionType.SKIP:
            raise ValueError(f"AutoTP: grad_allreduce applies to parameters left whole (partition_type 'skip'), "
                             f"patterns {self.patterns}")

    def _check_shape(self):
        if not isinstance(self.shape, tuple) or not self.shape:
            raise ValueError(f"AutoTP: shape must be a list of ints (a list of sizes at partition_dim), got "
                             f"{self.shape!r}")
        dim = self.get_partition_dim()
        if not 0 <= dim < len(self.shape):
            raise ValueError(f"AutoTP: partition_dim {dim} is outside shape {list(self.shape)}")
        for i, entry in enumerate(self.shape):
            if isinstance(entry, tuple):
                if i != dim or not entry or not all(isinstance(v, int) and v > 0 for v in entry):
                    raise ValueError(f"AutoTP: shape {self.shape!r}: a list of positive sub-parameter sizes is only "
                                     f"allowed at partition_dim ({dim})")
            elif not isinstance(entry, int) or isinstance(entry, bool) or entry == 0 or entry < -1:
                raise ValueError(f"AutoTP: shape {self.shape!r}: entries must be positive ints or -1")

    def get_partition_dim(self):
        if self.partition_dim is not None:
            return int(self.partition_dim)
        return 0 if self.partition_type == PartitionType.COLUMN else 1

    def has_unequal_sub_params(self):
        return self.shape is not None and isinstance(self.shape[self.get_partition_dim()], tuple)

    def get_sub_param_sizes(self):
        return self.shape[self.get_partition_dim()] if self.has_unequal_sub_params() else None

    def get_num_sub_params(self):
        if self.shape is None:
            return None
        entry = self.shape[self.get_partition_dim()]
        if isinstance(entry, tuple):
            return len(entry)
        return entry if entry > 0 else None

    def matches(self, param_name, model_type=None):
        if self.model_types:
            if model_type is None or str(model_type).lower() not in {str(m).lower() for m in self.model_types}:
                return False
        return any(re.match(pattern, param_name) for pattern in self.patterns)


@dataclass
class AutoTPConfig:
    """A list of rules, first match wins (module docstring)."""
    tp_size: int = 1
    layer_specs: List[TPLayerSpec] = field(default_factory=list)
    embedding_partition_dim: int = 1
    lm_head_patterns: List[str] = field(default_factory=lambda: ["lm_head", "embed_out"])
    use_default_specs: bool = True
    strict_mode: bool = False

    def find_matching_spec(self, param_name, model_type=None):
        for spec in self.layer_specs:
            if spec.matches(param_name, model_type):
                return spec
        return None

    @classmethod
    def from_dict(cls, config_dict):
        specs = []
        for raw in config_dict.get("layer_specs", []) or []:
            if isinstance(raw, TPLayerSpec):
                specs.append(raw)
                continue
            specs.append(
                TPLayerSpec(patterns=raw.get("patterns", []),
                            partition_type=raw.get("partition_type", "column"),
                            shape=raw.get("shape"),
                            partition_dim=raw.get("partition_dim"),
                            model_types=raw.get("model_types"),
                            gather_output=bool(raw.get("gather_output", False)),
                            grad_allreduce=bool(raw.get("grad_allreduce", False))))
        return cls(tp_size=int(config_dict.get("tp_size", 1)),
                   layer_specs=specs,
                   embedding_partition_dim=int(config_dict.get("embedding_partition_dim", 1)),
                   lm_head_patterns=list(config_dict.get("lm_head_patterns", ["lm_head", "embed_out"])),
                   use_default_specs=bool(config_dict.get("use_default_specs", True)),
                   strict_mode=bool(config_dict.get("strict_mode", False)))


def _spec(patterns, kind, **kw):
    return TPLayerSpec(patterns=patterns, partition_type=kind, **kw)


_ROW, _COL, _SKIP = PartitionType.ROW, PartitionType.COLUMN, PartitionType.SKIP


def _attention_and_mlp(qkv_specs, mlp_specs):
    return AutoTPConfig(layer_specs=[_spec([r".*\.self_attn\.o_proj\.weight$"], _ROW)] + qkv_specs +
                        [_spec([r".*\.mlp\.down_proj\.weight$"], _ROW)] + mlp_specs)


class AutoTPPresets:
    """Upstream's presets (module docstring)."""

    @staticmethod
    def llama():
        return _attention_and_mlp([_spec([r".*\.self_attn\.[qkv]_proj\.weight$"], _COL)],
                                  [_spec([r".*\.mlp\.(up|gate)_proj\.weight$"], _COL)])

    @staticmethod
    def llama_gqa(num_heads, num_kv_heads, head_dim):
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        return _attention_and_mlp(
            [_spec([r".*\.self_attn\.qkv_proj\.weight$"], _COL, shape=((q, kv, kv), -1), partition_dim=0)],
            [_spec([r".*\.mlp\.(up|gate)_proj\.weight$"], _COL)])

    @staticmethod
    def qwen2():
        return AutoTPPresets.llama()

    @staticmethod
    def phi3():
        return _attention_and_mlp([_spec([r".*\.self_attn\.qkv_proj\.weight$"], _COL, shape=(3, -1), partition_dim=0)],
                                  [_spec([r".*\.mlp\.gate_up_proj\.weight$"], _COL, shape=(2, -1), partition_dim=0)])

    @staticmethod
    def bloom():
        return AutoTPConfig(layer_specs=[
            _spec([r".*\.self_attention\.dense\.weight$"], _ROW),
            _spec([r".*\.self_attention\.query_key_value\.weight$"], _COL),
            _spec([r".*\.mlp\.dense_4h_to_h\.weight$"], _ROW),
            _spec([r".*\.mlp\.dense_h_to_4h\.weight$"], _COL),
        ])

    @staticmethod
    def chatglm():
        return AutoTPConfig(layer_specs=[
            _spec([r".*\.self_attention\.dense\.weight$"], _ROW),
            _spec([r".*\.self_attention\.query_key_value\.weight$"], _COL, shape=(3, -1), partition_dim=0),
            _spec([r".*\.mlp\.dense_4h_to_h\.weight$"], _ROW),
            _spec([r".*\.mlp\.dense_h_to_4h\.weight$"], _COL, shape=(2, -1), partition_dim=0),
        ])

    @staticmethod
    def mixtral():
        return AutoTPConfig(layer_specs=[
            _spec([r".*\.self_attn\.o_proj\.weight$"], _ROW),
            _spec([r".*\.self_attn\.[qkv]_proj\.weight$"], _COL),
            _spec([r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$"], _ROW),
            _spec([r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$"], _COL),
            _spec([r".*\.block_sparse_moe\.gate\.weight$"], _SKIP),
        ])

    @staticmethod
    def deepseek_v2():
        return AutoTPConfig(layer_specs=[
            _spec([r".*\.self_attn\.o_proj\.weight$"], _ROW),
            _spec([r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$"], _SKIP),
            _spec([r".*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$"], _COL),
            _spec([r".*\.mlp\.experts\.\d+\.down_proj\.weight$"], _ROW),
            _spec([r".*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$"], _COL),
            _spec([r".*\.mlp\.gate\.weight$"], _SKIP),
            _spec([r".*\.mlp\.shared_experts\.down_proj\.weight$"], _ROW),
            _spec([r".*\.mlp\.shared_experts\.(up|gate)_proj\.weight$"], _COL),
        ])

    @staticmethod
    def get_preset(model_type):
        preset = PRESETS.get(str(model_type).lower())
        return preset() if preset is not None else None


PRESETS = {
    "llama": AutoTPPresets.llama,
    "bloom": AutoTPPresets.bloom,
    "chatglm": AutoTPPresets.chatglm,
    "mixtral": AutoTPPresets.mixtral,
    "deepseek_v2": AutoTPPresets.deepseek_v2,
    "qwen2": AutoTPPresets.qwen2,
    "phi3": AutoTPPresets.phi3,
}


def merge_autotp_configs(base, override):
    """``override``'s specs first (they win), then ``base``'s; the other settings are ``override``'s."""
    return AutoTPConfig(tp_size=override.tp_size if override.tp_size > 1 else base.tp_size,
                        layer_specs=list(override.layer_specs) + list(base.layer_specs),
                        embedding_partition_dim=override.embedding_partition_dim,
                        lm_head_patterns=override.lm_head_patterns or base.lm_head_patterns,
                        use_default_specs=override.use_default_specs,
                        strict_mode=override.strict_mode)
