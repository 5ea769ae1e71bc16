# SPDX-License-Identifier: Apache-2.0
"""The ``expert_parallel`` config section (AutoEP): every key of upstream's section, parsed and checked.

A value is honoured, or refused by name (``NotImplementedError``) where this release cannot
compute it; a value upstream itself rejects raises ``ValueError`` with upstream's rule. Nothing
is accepted and ignored:

* routing (``top_k``, ``score_func``, ``score_apply``, ``route_norm``, ``route_scale``,
  ``routed_scaling_factor``, ``num_expert_groups``, ``num_limited_groups``, ``top_k_attr``) is
  resolved per block against the model's own router (``autoep_presets.resolve_routing``): equal,
  the model's router runs; different, :mod:`deepspeed.moe.autoep_router` routes as asked;
* ``combine_impl`` (``weighted_sum``, ``legacy_bmm``, ``fused_weighted_sum``), ``gate_up_impl``,
  ``async_split_plan``, ``disable_triton_grouped_mm``, ``validate_folding_routing`` and the
  DeepEP tuning numbers choose how a value is computed, never which: any value upstream accepts;
* ``moe_layer_pattern`` selects the sparse blocks (a regular expression on module names, fully
  matched); the pattern keys naming children or weights (``router_pattern``, ``expert_pattern``,
  ``expert_w1/w2/w3``, ``num_experts_attr``, ``has_shared_experts``, the shared-expert patterns)
  are honoured where they name what the preset's block holds, refused otherwise: the block's own
  ``forward`` runs, so another child cannot be put in its place;
* ``expert_activation``: ``swiglu`` and ``geglu_tanh``; refused: ``swiglu_clamped``, ``swiglu_oai``;
* refused: ``comm_backend: deepep`` (the DeepEP library is not built), ``expert_tensor_parallel_size`` > 1;
  ``load_balance_coeff`` other than null (upstream refuses it too).
"""

import re
from dataclasses import dataclass, fields
from typing import Optional, Union

_UNSET = "__unset__"

_CHOICES = {
    "score_func": ("auto", "softmax", "sigmoid"),
    "score_apply": ("auto", "pre", "post"),
    "combine_impl": ("auto", "weighted_sum", "fused_weighted_sum", "legacy_bmm"),
    "row_weighting_impl": ("auto", "eager", "fused"),
    "gate_up_impl": ("separate", "fused"),
    "comm_backend": ("comm", "deepep"),
}
EXPERT_ACTIVATIONS = ("swiglu", "geglu_tanh", "swiglu_clamped", "swiglu_oai")  # upstream's registered names
COMPUTED_ACTIVATIONS = ("swiglu", "geglu_tanh")
_BOOLS = ("enabled", "use_grouped_mm", "disable_triton_grouped_mm", "validate_folding_routing", "async_split_plan")
_NAMES = ("router_pattern", "expert_pattern", "expert_w1", "expert_w2", "num_experts_attr", "top_k_attr",
          "shared_experts_pattern", "shared_experts_gate_pattern")


@dataclass(frozen=True)
class AutoEPConfig:
    """The parsed section; field names and defaults are upstream's keys and defaults."""
    enabled: bool = False
    autoep_size: int = 1
    expert_tensor_parallel_size: int = 1
    validate_folding_routing: bool = False
    async_split_plan: bool = False
    preset_model: Optional[str] = None
    moe_layer_pattern: Optional[str] = None
    expert_pattern: Optional[str] = None
    router_pattern: Optional[str] = None
    use_grouped_mm: bool = True
    disable_triton_grouped_mm: bool = False
    route_norm: Optional[bool] = None
    route_scale: float = 1.0
    score_apply: str = "auto"
    combine_impl: str = "auto"
    row_weighting_impl: str = "auto"
    gate_up_impl: str = "separate"
    comm_backend: str = "comm"
    comm_num_sm: int = 12
    comm_qp_margin: int = 4
    comm_max_tokens_per_rank: int = 0
    num_expert_groups: Optional[int] = None
    num_limited_groups: Optional[int] = None
    score_func: str = "auto"
    top_k: Union[int, str] = "auto"
    load_balance_coeff: Optional[float] = None
    routed_scaling_factor: Union[float, str] = "auto"
    expert_w1: Optional[str] = None
    expert_w2: Optional[str] = None
    expert_w3: object = _UNSET  # absent: the preset's; null: fused gate and up; a name: a separate up weight
    num_experts_attr: Optional[str] = None
    top_k_attr: Optional[str] = None
    has_shared_experts: Optional[bool] = None
    shared_experts_pattern: Optional[str] = None
    shared_experts_gate_pattern: Optional[str] = None
    expert_activation: Optional[str] = None

    @classmethod
    def keys(cls):
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_section(cls, section):
        """Parse and check the section (a dict or None); the error names the offending key."""
        if section is None:
            return cls()
        if not isinstance(section, dict):
            raise ValueError(f"config section 'expert_parallel' must be a dict, got {type(section).__name__}")
        known = cls.keys()
        for key in section:
            if key not in known:
                raise ValueError(f"unknown config key 'expert_parallel.{key}'; accepted: {', '.join(known)}")
        cfg = cls(**section)
        cfg.check()
        return cfg

    def check(self):
        """Upstream's rules (ValueError) and the values this release cannot compute (NotImplementedError)."""

        def bad(key, why):
            raise ValueError(f"config key 'expert_parallel.{key}'={getattr(self, key)!r}: {why}")

        def refused(key, why):
            raise NotImplementedError(f"config key 'expert_parallel.{key}'={getattr(self, key)!r} is not supported: "
                                      f"{why}; see docs/moe.md")

        for key in _BOOLS:
            if not isinstance(getattr(self, key), bool):
                bad(key, "must be a boolean")
        for key, choices in _CHOICES.items():
            if getattr(self, key) not in choices:
                bad(key, f"must be one of {choices}")
        for key in ("autoep_size", "expert_tensor_parallel_size", "comm_num_sm"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                bad(key, "must be a positive int")
        for key in ("comm_qp_margin", "comm_max_tokens_per_rank"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                bad(key, "must be a non-negative int")
        if self.load_balance_coeff is not None:
            bad(
                "load_balance_coeff", "only null is accepted (auxiliary-loss-free balancing by an expert bias is "
                "not supported, as upstream)")
        if self.gate_up_impl == "fused" and not self.use_grouped_mm:
            bad("gate_up_impl", "'fused' needs use_grouped_mm=true")
        if self.row_weighting_impl == "fused" and (self.comm_backend != "deepep" or self.autoep_size == 1):
            bad("row_weighting_impl", "'fused' runs only on the DeepEP route (comm_backend 'deepep', autoep_size > 1)")
        if self.combine_impl == "fused_weighted_sum" and self.expert_tensor_parallel_size > 1:
            bad("combine_impl", "'fused_weighted_sum' needs expert_tensor_parallel_size=1")
        if self.combine_impl == "fused_weighted_sum" and self.score_apply == "pre":
            bad("combine_impl", "'fused_weighted_sum' needs score_apply 'post'")
        if self.comm_backend == "deepep" and self.comm_max_tokens_per_rank == 0:
            bad("comm_max_tokens_per_rank", "must be positive with comm_backend 'deepep'")
        if self.top_k != "auto" and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                     or self.top_k < 1):
            bad("top_k", "must be 'auto' or a positive int")
        if self.route_norm is not None and not isinstance(self.route_norm, bool):
            bad("route_norm", "must be null or a boolean")
        if self.has_shared_experts is not None and not isinstance(self.has_shared_experts, bool):
            bad("has_shared_experts", "must be null or a boolean")
        if isinstance(self.route_scale, bool) or not isinstance(self.route_scale, (int, float)):
            bad("route_scale", "must be a number")
        if self.routed_scaling_factor != "auto" and (isinstance(self.routed_scaling_factor, bool)
                                                     or not isinstance(self.routed_scaling_factor, (int, float))):
            bad("routed_scaling_factor", "must be a number or 'auto'")
        for key in ("num_expert_groups", "num_limited_groups"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                bad(key, "must be null or an int >= 1")
        if (self.num_expert_groups is not None and self.num_limited_groups is not None
                and self.num_limited_groups > self.num_expert_groups):
            bad("num_limited_groups", f"must be <= num_expert_groups ({self.num_expert_groups})")
        for key in _NAMES:
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value or "." in value):
                bad(key, "must be a non-empty attribute name without dots")
        if self.expert_w3 is not _UNSET and self.expert_w3 is not None and (not isinstance(self.expert_w3, str)
                                                                            or not self.expert_w3):
            bad("expert_w3", "must be null or an attribute name")
        if self.moe_layer_pattern is not None:
            try:
                re.compile(self.moe_layer_pattern)
            except (re.error, TypeError) as err:
                bad("moe_layer_pattern", f"not a regular expression ({err})")
        from deepspeed.moe.autoep_presets import PRESETS
        preset = self.preset_model
        if preset is not None and (not isinstance(preset, str) or preset not in PRESETS):
            bad("preset_model", f"not a known preset; known: {sorted(PRESETS)}")
        if self.expert_activation is not None and self.expert_activation not in EXPERT_ACTIVATIONS:
            bad("expert_activation", f"must be one of {EXPERT_ACTIVATIONS}")
        # What this release cannot compute.
        if self.comm_backend == "deepep":
            refused(
                "comm_backend", "the DeepEP library is not built here; 'comm' (all-to-all over the expert-"
                "parallel group) computes the same values")
        if self.expert_tensor_parallel_size > 1:
            refused("expert_tensor_parallel_size", "experts are not cut over tensor-parallel ranks")
        if self.expert_activation is not None and self.expert_activation not in COMPUTED_ACTIVATIONS:
            refused("expert_activation", f"only {COMPUTED_ACTIVATIONS} are computed")
        if self.expert_w3 is not _UNSET and self.expert_w3 is not None:
            refused("expert_w3", "experts with a separate up-projection weight are not computed (fused "
                    "gate_up_proj only)")
