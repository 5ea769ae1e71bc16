# SPDX-License-Identifier: Apache-2.0
"""The sharding plan: which linear layers are cut, and how, as data.

Three sources, in order (the first that applies gives the plan):

1. ``tensor_parallel.partition_config`` and/or ``preset_model`` (``autotp_config.py``): layer specs
   matched against each linear layer's weight name;
2. the model's Hugging Face ``tp_plan`` (``tp_plan_converter.py``), turned into the same specs;
3. a heuristic for decoder models: in every block of a ``ModuleList`` of blocks, the linear
   layers of one sub-module (attention, MLP) are column parallel except the one that feeds the
   residual stream (an output projection by name -- ``o_proj``, ``down_proj``, ``w2``... -- or else
   the last one), which is row parallel; an untied ``lm_head`` is column parallel with its
   output gathered.

Each gives a :class:`ShardingPlan`: module name -> :class:`LayerRule`, plus the parameters the
rules declare summed over the group (``grad_allreduce`` / ``replicated_with_grad_allreduce``).
``sharding.apply_plan`` is the one function that applies a plan. A linear layer whose weight is
shared with another module (an LM head tied to the embedding) is never cut: it stays one
parameter.
"""

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from torch import nn

from deepspeed.module_inject.autotp_config import AutoTPConfig, PartitionType
from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan

ROW_NAMES = ("o_proj", "down_proj", "out_proj", "dense", "dense_4h_to_h", "w2", "wo", "c_proj", "fc2")
LM_HEAD_NAMES = ("lm_head", "embed_out")


@dataclass(frozen=True)
class LayerRule:
    """How one linear layer is cut: ``kind`` "column" or "row"; a fused weight's ``shape``/``partition_dim``."""
    kind: str
    gather_output: bool = False
    shape: Optional[tuple] = None
    partition_dim: Optional[int] = None


@dataclass
class ShardingPlan:
    """Module name -> rule, and where the rules came from (module docstring)."""
    source: str
    layers: Dict[str, LayerRule] = field(default_factory=dict)
    grad_sum: Tuple[str, ...] = ()  # parameter names the rules declare summed over the group

    def describe(self):
        counts = {}
        for rule in self.layers.values():
            key = rule.kind + (" (gathered)" if rule.gather_output else "")
            counts[key] = counts.get(key, 0) + 1
        return f"{self.source}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


def _model_type(model):
    return getattr(getattr(model, "config", None), "model_type", None)


def _shared_weights(model):
    """Parameters reached under more than one module (tied weights)."""
    owners = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for _, p in module.named_parameters(recurse=False):
            owners.setdefault(p, set()).add(id(module))
    return {p for p, mods in owners.items() if len(mods) > 1}


def plan_from_specs(model, config, source):
    """The plan a list of layer specs gives (``config``: an ``AutoTPConfig``)."""
    model_type = _model_type(model)
    tied = _shared_weights(model)
    plan = ShardingPlan(source)
    grad_sum = []
    for name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            spec = config.find_matching_spec(full, model_type)
            if spec is None:
                continue
            if spec.partition_type == PartitionType.SKIP:
                if spec.grad_allreduce:
                    grad_sum.append(full)
                continue
            if pname != "weight":
                continue
            if not isinstance(module, nn.Linear):
                if param.dim() >= 2:
                    raise NotImplementedError(f"AutoTP: {name} ({type(module).__name__}) matches a "
                                              f"'{spec.partition_type.value}' rule, but only torch.nn.Linear layers "
                                              f"are cut in training (patterns {spec.patterns})")
                continue
            if param in tied:
                continue  # a tied weight stays one parameter
            plan.layers[name] = LayerRule(kind=spec.partition_type.value,
                                          gather_output=spec.gather_output,
                                          shape=spec.shape,
                                          partition_dim=spec.partition_dim)
    if getattr(config, "strict_mode", False):
        missing = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in plan.layers]
        if missing:
            raise ValueError(f"AutoTP: strict_mode: no layer spec matches the linear layers {missing[:6]}")
    plan.grad_sum = tuple(grad_sum)
    return plan


def _blocks(model):
    """The blocks of every ``ModuleList`` of blocks (elements holding two linear layers or more)."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            for i, block in enumerate(module):
                if sum(isinstance(m, nn.Linear) for m in block.modules()) >= 2:
                    out.append((f"{name}.{i}" if name else str(i), block))
    return out


def heuristic_plan(model):
    """The decoder-block heuristic (module docstring)."""
    tied = _shared_weights(model)
    plan = ShardingPlan("heuristic")
    seen = set()
    for block_name, block in _blocks(model):
        groups = {}
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear):
                parent = name.rsplit(".", 1)[0] if "." in name else ""
                groups.setdefault(parent, []).append(name)
        for parent, names in groups.items():
            full = [f"{block_name}.{n}" for n in names]
            if len(names) < 2 or any(f in seen for f in full):
                continue
            by_name = [n for n in names if n.rsplit(".", 1)[-1] in ROW_NAMES]
            row = by_name[-1] if by_name else names[-1]
            for n, f in zip(names, full):
                seen.add(f)
                module = block.get_submodule(n)
                if module.weight in tied:
                    continue
                plan.layers[f] = LayerRule(kind="row" if n == row else "column")
    for name in LM_HEAD_NAMES:
        head = getattr(model, name, None)
        if isinstance(head, nn.Linear) and head.weight not in tied:
            plan.layers[name] = LayerRule(kind="column", gather_output=True)
    return plan


def build_plan(model, tp_config):
    """The plan of ``model`` under the ``tensor_parallel`` section ``tp_config`` (module docstring)."""
    custom = tp_config.get_partition_config_object()
    if custom is not None:
        return plan_from_specs(model, custom, "partition_config" if tp_config.partition_config else "preset")
    hf_plan = _get_hf_tp_plan(model)
    if hf_plan:
        specs = TPPlanConverter.convert(hf_plan)
        if specs:
            return plan_from_specs(model, AutoTPConfig(layer_specs=specs), "tp_plan")
    return heuristic_plan(model)
