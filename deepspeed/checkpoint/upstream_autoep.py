# SPDX-License-Identifier: Apache-2.0
"""Reading upstream DeepSpeed 0.19.8's AutoEP checkpoints (ZeRO 1, 2 and 3) into this package's AutoEP layout.

The facts of upstream's format this relies on (written on CPU/gloo with upstream 0.19.8; the fixture is
``tests/unit/checkpoint/upstream/fixtures_autoep``): upstream replaces each sparse block whole, so

* the model-states file's ``module`` holds the router as ``<block>.router.gate.weight`` (and a copy under
  ``<block>.gate.gate.weight``) and no expert; ``ds_autoep_layers`` lists per MoE layer its
  ``moe_layer_id``, ``num_experts``, ``ep_size``, ``expert_key_prefix`` (``<block>.experts``),
  ``expert_data_parallel_world_size`` and ``expert_placement`` (each expert-parallel rank's experts);
* ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt`` holds expert ``E`` of layer ``L`` as
  ``<prefix>.w1.<E>`` ``[F, H]`` (the gate projection), ``<prefix>.w3.<E>`` ``[F, H]`` (the up projection) and
  ``<prefix>.w2.<E>`` ``[H, F]``;
* the optimizer files hold the dense parameters in the usual partitioned groups and the experts in param groups
  marked ``moe`` (named ``ep_size_<ep>``), partitioned over the expert-data-parallel group: rank ``r`` is
  expert-parallel rank ``r % ep`` and expert-data-parallel rank ``r // ep``; the ranks of expert-parallel rank
  ``j`` (``j, j + ep, ...``, in that order) split the flat group of ``j``'s local experts' ``w1``, ``w2``, ``w3``
  (``[L, F, H]`` ...) between them, each naming its fragments in ``param_slice_mappings`` (with one rank per
  expert-data-parallel group, rank ``j`` holds them whole);
* on ZeRO 3 (layers marked ``checkpoint_format: zero3_partitioned``) no expert file is written: the experts are
  the ``moe`` optimizer param group's sub-groups of ``fp32_flat_groups``, each of its parameters cut into equal
  shards (the last padded) over the ranks ``ds_zero_partition_groups`` lists for that sub-group (the
  expert-data-parallel group, in partition-rank order), and each rank's flat sub-group the concatenation of its
  shards in ``param_shapes`` order.

This package keeps the model's block and stacks the experts as ``gate_up_proj [E, 2F, H]`` (gate rows first) and
``down_proj [E, H, F]``. The functions below give every expert parameter under this package's name with all
``E`` experts stacked (global order); ``runtime.checkpoint.expert.localize_global_experts`` cuts out each rank's.
"""

import os
import re

import torch

from deepspeed.checkpoint import constants as C
from deepspeed.runtime.checkpoint.reader import load_file
from deepspeed.checkpoint.zero3_shards import join_zero3_shards
from deepspeed.runtime.checkpoint.validate import CheckpointError

LAYERS_KEY = "ds_autoep_layers"
EXPERT_FILE = re.compile(r"layer_\d+_expert_\d+_mp_rank_\d+_model_states\.pt")
_ROUTER = ".router.gate.weight"
_ROUTER_COPY = ".gate.gate.weight"


def is_autoep(model_states):
    """Whether an upstream model-states dict was written by upstream's AutoEP."""
    return isinstance(model_states, dict) and bool(model_states.get(LAYERS_KEY))


def rename(name):
    """This package's name of an upstream AutoEP module entry (its router lives under ``router.gate``)."""
    return name[:-len(_ROUTER)] + ".gate.weight" if name.endswith(_ROUTER) else name


def _layers(model_states):
    return sorted(model_states[LAYERS_KEY], key=lambda layer: layer["moe_layer_id"])


def _fused(w1, w3, w2):
    """``(gate_up_proj, down_proj)`` from upstream's per-expert ``w1``, ``w3``, ``w2`` (stacked on dim 0)."""
    return torch.cat([w1, w3], dim=-2), w2


def zero3_partitioned(model_states):
    """Whether upstream wrote the experts into the ZeRO-3 partitions (no per-expert files)."""
    return any(layer.get("checkpoint_format") == "zero3_partitioned" for layer in _layers(model_states))


def expert_shapes(model_states):
    """``{name: shape}`` of this package's stacked expert parameters (all ``E`` experts) for every AutoEP layer, from
    the local shapes ``param_shapes`` lists (``<prefix>.w1`` ``[L, F, H]``, ``<prefix>.w2`` ``[L, H, F]``)."""
    local = {name: tuple(shape) for group in model_states.get(C.PARAM_SHAPES) or [] for name, shape in group.items()}
    out = {}
    for layer in _layers(model_states):
        prefix, experts = layer["expert_key_prefix"], int(layer["num_experts"])
        w1, w2 = local.get(f"{prefix}.w1"), local.get(f"{prefix}.w2")
        if w1 is None or w2 is None:
            raise CheckpointError(f"upstream AutoEP layer '{prefix}': its 'w1'/'w2' are not in '{C.PARAM_SHAPES}'")
        out[f"{prefix}.gate_up_proj"] = (experts, 2 * w1[1], w1[2])
        out[f"{prefix}.down_proj"] = (experts, ) + tuple(w2[1:])
    return out


def _layers_and_size(model_states, saved, files):
    """``({expert_key_prefix: layer}, expert-parallel size)``; one size over a world it divides, else raise."""
    layers = {layer["expert_key_prefix"]: layer for layer in _layers(model_states)}
    ep = {int(layer["ep_size"]) for layer in layers.values()}
    if len(ep) != 1 or len(saved) % next(iter(ep)) != 0:
        raise NotImplementedError(f"{files[0]}: upstream AutoEP layers with expert-parallel sizes {sorted(ep)} over "
                                  f"{len(saved)} ranks")
    return layers, next(iter(ep))


def module_values(directory, model_states, values):
    """The saved module in this package's names, every expert stacked in global order (read from the layer files;
    a ZeRO-3 save has none: its experts are in the optimizer partitions, read by :func:`zero3_expert_group`)."""
    out = {}
    for name, value in values.items():
        if name.endswith(_ROUTER_COPY) and name[:-len(_ROUTER_COPY)] + _ROUTER in values:
            continue  # upstream's second name of the router weight
        out[rename(name)] = value
    if zero3_partitioned(model_states):
        return out
    for layer in _layers(model_states):
        prefix, lid = layer["expert_key_prefix"], layer["moe_layer_id"]
        weights = {"w1": [], "w2": [], "w3": []}
        for e in range(int(layer["num_experts"])):
            path = os.path.join(directory, f"layer_{lid}_expert_{e}_mp_rank_00_model_states.pt")
            saved = load_file(path, f"expert {e} of upstream AutoEP layer {lid}")
            for w in weights:
                key = f"{prefix}.{w}.{e}"
                if key not in saved:
                    raise CheckpointError(f"{path}: no '{key}'")
                weights[w].append(saved[key])
        gate_up, down = _fused(*(torch.stack(weights[w]) for w in ("w1", "w3", "w2")))
        out[f"{prefix}.gate_up_proj"], out[f"{prefix}.down_proj"] = gate_up, down
    return out


def is_expert_group(base_optimizer_state, g):
    groups = base_optimizer_state.get(C.PARAM_GROUPS) if isinstance(base_optimizer_state, dict) else None
    return bool(groups and groups[g].get("moe"))


def expert_group(model_states, saved, files, g, group, group_state, with_state):
    """``(names, fp32, state)`` of upstream's expert param group ``g`` in this package's names, experts stacked.

    ``saved``/``files``: every rank's ``optimizer_state_dict`` and path; ``group``: the group's ``param_shapes``
    entry (upstream name -> local shape); ``group_state(osd, g, path)``: the inner optimizer's state of the group.
    """
    layers, ep = _layers_and_size(model_states, saved, files)
    edp = len(saved) // ep
    for layer in layers.values():
        saved_edp = int(layer.get("expert_data_parallel_world_size") or 1)
        if saved_edp != edp:
            raise CheckpointError(f"{files[0]}: layer '{layer.get('module_path')}' names expert-data-parallel size "
                                  f"{saved_edp}, but {len(saved)} ranks at expert-parallel size {ep} make {edp}")
    states = [group_state(osd, g, path) for osd, path in zip(saved, files)]

    def local(j, name, shape, source_of):
        """Expert-parallel rank ``j``'s value of ``name``: its expert-data-parallel ranks' fragments, in order."""
        numel = 1
        for d in shape:
            numel *= int(d)
        chunks = []
        for rank in range(j, len(saved), ep):
            address = saved[rank][C.PARAM_SLICE_MAPPINGS][g].get(name)
            if address is not None:
                chunks.append(source_of(rank).narrow(0, address.start, address.numel))
        if sum(c.numel() for c in chunks) != numel:
            raise CheckpointError(f"{files[j]}: the fragments of '{name}' in param group {g} over ranks "
                                  f"{list(range(j, len(saved), ep))} hold {sum(c.numel() for c in chunks)} "
                                  f"elements, its shape {tuple(shape)} needs {numel}")
        return torch.cat(chunks).view(tuple(shape))

    def stacked(name, shape, source_of):
        # expert-parallel rank j's experts come first (global expert order)
        return torch.cat([local(j, name, shape, source_of) for j in range(ep)])

    keys = [k for k, v in states[0].items() if torch.is_tensor(v) and v.dim() == 1 and k != "step"]
    scalars = {k: v for k, v in states[0].items() if k not in keys}
    names, fp32, state = [], {}, {}
    for prefix in sorted({n.rsplit(".", 1)[0] for n in group}):
        if prefix not in layers:
            raise CheckpointError(f"{files[0]}: '{prefix}' of param group {g} is in no AutoEP layer")
        parts = {w: f"{prefix}.{w}" for w in ("w1", "w3", "w2")}
        values = {
            w: stacked(n, group[n], lambda j: saved[j][C.SINGLE_PARTITION_OF_FP32_GROUPS][g])
            for w, n in parts.items()
        }
        gate_up, down = _fused(values["w1"], values["w3"], values["w2"])
        ours = (f"{prefix}.gate_up_proj", f"{prefix}.down_proj")
        names += list(ours)
        fp32[ours[0]], fp32[ours[1]] = gate_up.float(), down.float()
        if with_state:
            for name in ours:
                state[name] = dict(scalars)
            for key in keys:
                per = {w: stacked(n, group[n], lambda j, key=key: states[j][key]) for w, n in parts.items()}
                state[ours[0]][key], state[ours[1]][key] = _fused(per["w1"], per["w3"], per["w2"])
    return names, fp32, state


def zero3_expert_group(model_states, saved, files, i, group, with_state):
    """``(names, fp32, state)`` of upstream's ZeRO-3 expert sub-group ``i`` in this package's names, experts stacked
    in global order.

    ``saved``/``files``: every rank's ``optimizer_state_dict`` and path; ``group``: the sub-group's ``param_shapes``
    entry (upstream name -> local shape, in flat order)."""
    layers, ep = _layers_and_size(model_states, saved, files)

    def holders(j):
        """The ranks sharding expert-parallel rank ``j``'s sub-group, in partition-rank order."""
        entries = saved[j].get("ds_zero_partition_groups")
        if not isinstance(entries, (list, tuple)) or len(entries) <= i or "partition_ranks" not in entries[i]:
            raise CheckpointError(f"{files[j]}: no 'ds_zero_partition_groups' entry for expert sub-group {i}")
        return [int(r) for r in entries[i]["partition_ranks"]]

    ranks = [holders(j) for j in range(ep)]

    def whole(j, source_of, key):
        """name -> expert-parallel rank ``j``'s full local value of each parameter of the sub-group."""
        parts = [source_of(r) for r in ranks[j]]
        out, offset = {}, 0
        for name, shape in group.items():

            def too_short(k, name=name):
                raise CheckpointError(f"{files[ranks[j][k]]}: '{key}' of sub-group {i} is too short for '{name}'")

            numel = 1
            for d in shape:
                numel *= int(d)
            value, shard = join_zero3_shards(parts, numel, offset, too_short)
            out[name] = value.view(tuple(shape))
            offset += shard
        return out

    def stacked(source_of, key):
        per_rank = [whole(j, source_of, key) for j in range(ep)]
        return {name: torch.cat([values[name] for values in per_rank]) for name in group}

    def fused(values):
        out = {}
        for prefix in sorted({n.rsplit(".", 1)[0] for n in group}):
            if prefix not in layers:
                raise CheckpointError(f"{files[0]}: '{prefix}' of sub-group {i} is in no AutoEP layer")
            gate_up, down = _fused(values[f"{prefix}.w1"], values[f"{prefix}.w3"], values[f"{prefix}.w2"])
            out[f"{prefix}.gate_up_proj"], out[f"{prefix}.down_proj"] = gate_up, down
        return out

    values = fused(stacked(lambda r: saved[r][C.FP32_FLAT_GROUPS][i], C.FP32_FLAT_GROUPS))
    fp32 = {name: value.float() for name, value in values.items()}
    names = list(fp32)
    state = {}
    if with_state:
        states = [osd[C.OPTIMIZER_STATE_DICT]["state"].get(i, {}) for osd in saved]
        for name in names:
            state[name] = {k: (v.clone() if torch.is_tensor(v) else v)
                           for k, v in states[0].items() if not (torch.is_tensor(v) and v.dim() == 1)}
        for key, value in states[0].items():
            if torch.is_tensor(value) and value.dim() == 1:
                for name, v in fused(stacked(lambda r, key=key: states[r][key], key)).items():
                    state[name][key] = v
    return names, fp32, state
