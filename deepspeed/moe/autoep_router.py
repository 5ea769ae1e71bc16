# SPDX-License-Identifier: Apache-2.0
"""AutoEP's router for a block whose config asks for other routing than the model's own.

:func:`route` computes a :class:`~deepspeed.moe.autoep_presets.RoutingSpec` from the router's own
``weight`` (and ``e_score_correction_bias``), returning what every HF router returns:
``(logits [T, E], weights [T, k], experts [T, k])``. :func:`install_routing` makes a model's router
module use it: the module keeps its parameters, buffers, name and hooks (its class becomes a
subclass of its own, ``AutoEPRouted<class>``, whose ``forward`` is :func:`route`), so checkpoints and
HF's router-logit recording (an ``isinstance`` match) see the same module. With a spec equal to the
model's own router the result is the model's, bit for bit (the same operations in the same order;
tested against the HF model).
"""

import torch
import torch.nn.functional as F

_ROUTED_CLASSES = {}


def route(router, spec, hidden_states):
    """``(logits, weights, experts)`` of ``hidden_states`` (any shape ``[..., H]``) under ``spec``."""
    weight = router.weight
    x = hidden_states.reshape(-1, weight.shape[1])
    if spec.logits_fp32:
        logits = F.linear(x.float(), weight.float())
    else:
        logits = F.linear(x, weight)
    if spec.score_func == "sigmoid":
        scores = logits.float().sigmoid()
    else:
        scores = torch.softmax(logits.float(), dim=-1)
    choice = scores
    if spec.correction_bias and getattr(router, "e_score_correction_bias", None) is not None:
        choice = scores + router.e_score_correction_bias
    if spec.num_expert_groups is not None:
        groups, num_experts = spec.num_expert_groups, scores.shape[-1]
        grouped = choice.view(-1, groups, num_experts // groups)
        if spec.group_score_func == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        chosen = torch.topk(group_scores, k=spec.num_limited_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, chosen, 1).bool()
        keep = keep.unsqueeze(-1).expand(-1, groups, num_experts // groups).reshape(-1, num_experts)
        choice = choice.masked_fill(~keep, spec.masked_score)
    experts = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if spec.route_norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if spec.route_scale != 1.0:
        weights = weights * spec.route_scale
    if not spec.weights_fp32:
        weights = weights.to(logits.dtype)
    return logits, weights, experts


def _routed_forward(self, hidden_states):
    return route(self, self._autoep_routing, hidden_states)


def install_routing(router, spec):
    """Route with ``spec`` in ``router`` (in place; see the module docstring)."""
    cls = type(router)
    base = getattr(cls, "_autoep_base", cls)
    routed = _ROUTED_CLASSES.get(base)
    if routed is None:
        name = f"AutoEPRouted{base.__name__}"
        routed = type(name, (base, ), {"forward": _routed_forward, "_autoep_base": base, "__module__": __name__})
        globals()[name] = routed  # found by name, so that a model holding it pickles
        _ROUTED_CLASSES[base] = routed
    router.__class__ = routed
    router._autoep_routing = spec
