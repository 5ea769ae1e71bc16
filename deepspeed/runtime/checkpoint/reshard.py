# SPDX-License-Identifier: Apache-2.0
"""From per-rank ZeRO 1/2 partitions to full tensors by parameter name: the stage-independent ``FullState``.

A ZeRO 1/2 optimizer file holds one data-parallel rank's partition of a
:class:`~deepspeed.runtime.zero.partitions.partition_layout.PartitionedLayout`: for each param
group, the concatenation of the rank's chunk of each of the group's buckets. With the
layout described in the file (written by the stage,
``deepspeed/runtime/zero/checkpoint/partitioned.py``: the world size, every parameter's
name, shape, group and offset in the full space, every bucket's start, size, padding,
chunk and offset in the partition), the files of all ranks give back
the full space, and so every parameter's fp32 value and every optimizer state tensor
shaped like the flat partition (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``...).

:class:`FullState` is that stage-independent form, keyed by parameter name. It is what
resharding goes through (W ranks to W', any stage to any other), and what
``zero_to_fp32`` reads; each stage cuts it into its own layout
(``StageCheckpoint.prepare_import``). Building it needs the full state in memory on the
rank that builds it; a load into the same layout it was saved from does not build it.
"""

from dataclasses import dataclass, field

import torch

from deepspeed.runtime.checkpoint.validate import CheckpointError

LAYOUT_KEY = "partition_layout"
STEP_KEY = "step"


@dataclass
class FullState:
    """Training state of the fp32 parameters, by name, independent of stage and world size.

    ``fp32``: name -> full fp32 value (the parameter's shape). ``state``: name -> the
    inner optimizer's state of that parameter, tensors shaped like the parameter and
    per-parameter scalars (``step``) as saved. ``groups``: per param group, its
    hyperparameters (the saved ``param_groups`` entry without ``params``), or None when
    unknown. ``group_names``: per param group, the names of its parameters.
    """
    fp32: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)
    groups: list = field(default_factory=list)
    group_names: list = field(default_factory=list)


def same_layout(a, b):
    """Whether two layout descriptions partition the same parameters the same way (the rank aside)."""
    keys = ("world_size", "numel", "group_part_numel", "params", "buckets")
    return all(a.get(k) == b.get(k) for k in keys)


def _check_files(payloads, names):
    """The layout shared by every rank's file; CheckpointError naming the first file that disagrees."""
    first = payloads[0].get(LAYOUT_KEY)
    if first is None:
        raise CheckpointError(f"{names[0]}: no '{LAYOUT_KEY}' entry; this optimizer file was not written by this "
                              f"runtime and cannot be resharded")
    if first["world_size"] != len(payloads):
        raise CheckpointError(f"{names[0]}: written for {first['world_size']} ranks, but {len(payloads)} rank "
                              f"files were given")
    for rank, (payload, name) in enumerate(zip(payloads, names)):
        layout = payload.get(LAYOUT_KEY)
        if layout is None or not same_layout(layout, first):
            raise CheckpointError(f"{name}: its partition layout differs from that of {names[0]}; the files come "
                                  f"from different saves")
        if layout["rank"] != rank:
            raise CheckpointError(f"{name}: holds the partition of rank {layout['rank']}, expected rank {rank}")
        parts = payload["single_partition_of_fp32_groups"]
        if len(parts) != len(first["group_part_numel"]):
            raise CheckpointError(f"{name}: {len(parts)} fp32 partitions for {len(first['group_part_numel'])} "
                                  f"param groups")
        for g, (part, numel) in enumerate(zip(parts, first["group_part_numel"])):
            if part.numel() != numel:
                raise CheckpointError(f"{name}: the fp32 partition of param group {g} has {part.numel()} elements, "
                                      f"the layout says {numel}")
    return first


def _expert_names(layout):
    """Names of the parameters in expert buckets (ep > 1): their values differ by expert-parallel rank under one name
    and come from the expert states files (``runtime/checkpoint/expert.py``), not from the partitions."""
    spans = [(b["start"], b["start"] + b["numel"]) for b in layout["buckets"] if b.get("expert")]
    return {p["name"] for p in layout["params"] if any(lo <= p["offset"] < hi for lo, hi in spans)}


def _assemble(layout, part_of, dtype, groups):
    """The full space from every rank's partitions; ``part_of(rank, group)`` is one partition. Padding stays zero."""
    full = torch.zeros(layout["numel"], dtype=dtype)
    for rank in range(layout["world_size"]):
        for b in layout["buckets"]:
            if b["group"] in groups and not b.get("expert"):
                chunk = b["chunk"]
                src = part_of(rank, b["group"]).narrow(0, b["part_offset"], chunk)
                full.narrow(0, b["start"] + rank * chunk, chunk).copy_(src)
    return full


def _split(layout, full, groups):
    """name -> the (cloned) value in the full space ``full`` of each parameter of ``groups`` (experts left out)."""
    experts = _expert_names(layout)
    return {
        p["name"]: full.narrow(0, p["offset"], p["numel"]).view(p["shape"]).clone()
        for p in layout["params"] if p["group"] in groups and p["name"] not in experts
    }


def _group_state(payload, group):
    """The inner optimizer's state of ``group``'s flat master in one rank's file ({} when it has none)."""
    sd = payload["base_optimizer_state"]
    indices = sd["param_groups"][group]["params"]
    if not indices:
        return {}
    return sd["state"].get(indices[0], {})


def _is_partitioned(key, value, numel):
    return key != STEP_KEY and torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel


def full_state_from_partitions(payloads, names, with_state=True):
    """A :class:`FullState` from the ``optimizer_state_dict`` of every saved rank (index = rank).

    ``names`` are the files' paths (for messages). With ``with_state=False`` only the
    fp32 values are rebuilt (what ``zero_to_fp32`` needs).
    """
    layout = _check_files(payloads, names)
    all_groups = set(range(len(layout["group_part_numel"])))
    fp32_parts = [p["single_partition_of_fp32_groups"] for p in payloads]
    full = _assemble(layout, lambda rank, g: fp32_parts[rank][g], torch.float32, all_groups)
    result = FullState(fp32=_split(layout, full, all_groups))
    del full
    result.group_names = [[p["name"] for p in layout["params"] if p["group"] == g] for g in sorted(all_groups)]
    if not with_state:
        return result
    saved_groups = payloads[0]["base_optimizer_state"]["param_groups"]
    if len(saved_groups) != len(all_groups):
        raise CheckpointError(f"{names[0]}: {len(saved_groups)} optimizer param groups for "
                              f"{len(all_groups)} partitioned groups")
    result.groups = [{k: v for k, v in group.items() if k != "params"} for group in saved_groups]
    per_name = {p["name"]: {} for p in layout["params"]}
    partitioned = {}  # state key -> (dtype, groups where it is a flat partition)
    for g in sorted(all_groups):
        numel = layout["group_part_numel"][g]
        for key, value in _group_state(payloads[0], g).items():
            if _is_partitioned(key, value, numel):
                partitioned.setdefault(key, (value.dtype, set()))[1].add(g)
            else:
                for pname in result.group_names[g]:
                    per_name[pname][key] = value.clone() if torch.is_tensor(value) else value
    for key, (dtype, groups) in partitioned.items():
        for g in groups:
            numel = layout["group_part_numel"][g]
            for payload, name in zip(payloads, names):
                if not _is_partitioned(key, _group_state(payload, g).get(key), numel):
                    raise CheckpointError(f"{name}: optimizer state '{key}' of param group {g} is missing or not a "
                                          f"partition of {numel} elements")
        full = _assemble(layout, lambda rank, g, key=key: _group_state(payloads[rank], g)[key], dtype, groups)
        for pname, tensor in _split(layout, full, groups).items():
            per_name[pname][key] = tensor
        del full
    result.state = {name: st for name, st in per_name.items() if st}
    return result


def merge_group_scalars(state_of_params, group, describe):
    """The scalar state (``step``...) shared by the parameters of one group; CheckpointError if they differ."""
    merged = {}
    source = {}
    for name, state in state_of_params:
        for key, value in state.items():
            if key not in merged:
                merged[key], source[key] = value, name
                continue
            same = torch.equal(torch.as_tensor(merged[key]), torch.as_tensor(value)) if (
                torch.is_tensor(value) or torch.is_tensor(merged[key])) else merged[key] == value
            if not same:
                raise CheckpointError(f"{describe}: optimizer state '{key}' differs between parameters "
                                      f"'{source[key]}' and '{name}' of param group {group}; one partitioned group "
                                      f"keeps one value")
    return merged
