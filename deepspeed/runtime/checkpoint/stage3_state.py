# SPDX-License-Identifier: Apache-2.0
"""Reading a ZeRO stage-3 checkpoint's per-rank optimizer files back into full tensors by name.

On stage 3 every parameter ``p`` is flattened, padded to ``W * s`` (``s`` its shard
size) and rank ``r`` owns elements ``[r*s, (r+1)*s)``. For param group ``g`` the
rank's fp32 master partition (``fp32_flat_groups[g]``), and every optimizer state
tensor shaped like it, hold ``p``'s shard at its ``part_offset``; frozen parameters'
16-bit shards are in ``frozen_16bit_shards``. Each file's ``zero3_layout`` (written by
the stage, ``deepspeed/runtime/zero/checkpoint/stage3.py``) gives the world size and,
per parameter, its name, shape, numel, shard size, group and part offset.

:func:`full_state_from_zero3` concatenates every saved rank's shards and cuts them to
``numel``: each parameter's full fp32 value and full optimizer state (a
:class:`~deepspeed.runtime.checkpoint.reshard.FullState`, what any stage imports), and
the full 16-bit value of each frozen parameter. ``zero_to_fp32`` reads the same. Parameters marked
``expert`` (sharded over their expert-data-parallel group; their values differ by expert-parallel rank
under one name) are left out: they come from the expert files (``runtime/checkpoint/expert.py``).
"""

import torch

from deepspeed.runtime.checkpoint.reshard import STEP_KEY, FullState
from deepspeed.runtime.checkpoint.validate import CheckpointError

LAYOUT3_KEY = "zero3_layout"


def same_zero3_layout(a, b):
    """Whether two ``zero3_layout`` descriptions shard the same parameters the same way (the rank aside)."""
    keys = ("world_size", "num_groups", "group_part_numel", "frozen_part_numel", "params")
    return all(a.get(k) == b.get(k) for k in keys)


def _full_value(parts, entry, dtype):
    """Concatenate every saved rank's shard of one parameter and cut it to its shape."""
    off, shard = entry["part_offset"], entry["shard"]
    flat = torch.cat([part.narrow(0, off, shard).to(dtype) for part in parts])
    return flat[:entry["numel"]].view(entry["shape"]).clone()


def _group_state(saved, g):
    sd = saved["base_optimizer_state"]
    indices = sd["param_groups"][g]["params"]
    return sd["state"].get(indices[0], {}) if indices else {}


def full_state_from_zero3(payloads, names, with_state=True):
    """``(FullState, frozen)`` from every saved rank's ``optimizer_state_dict`` (index = rank).

    ``frozen``: name -> full 16-bit value of each frozen parameter saved (empty when excluded).
    """
    layouts = [p.get(LAYOUT3_KEY) if isinstance(p, dict) else None for p in payloads]
    first = layouts[0]
    for layout, name in zip(layouts, names):
        if layout is None:
            raise CheckpointError(f"{name}: not a ZeRO stage 3 optimizer file of this runtime (no {LAYOUT3_KEY})")
        if layout["world_size"] != len(payloads) or not same_zero3_layout(layout, first):
            raise CheckpointError(f"{name}: its layout does not match the other ranks' files (world size "
                                  f"{layout['world_size']}, {len(payloads)} files)")
    num_groups = first["num_groups"]
    masters = [p["fp32_flat_groups"] for p in payloads]
    result = FullState()
    frozen = {}
    frozen_parts = [p.get("frozen_16bit_shards") for p in payloads]
    for entry in first["params"]:
        g = entry["group"]
        if entry.get("expert"):
            continue
        if g < num_groups:
            result.fp32[entry["name"]] = _full_value([m[g] for m in masters], entry, torch.float32)
        elif all(part is not None for part in frozen_parts):
            frozen[entry["name"]] = _full_value(frozen_parts, entry, frozen_parts[0].dtype)
    result.group_names = [[e["name"] for e in first["params"] if e["group"] == g] for g in range(num_groups)]
    if not with_state:
        return result, frozen
    saved_groups = payloads[0]["base_optimizer_state"]["param_groups"]
    if len(saved_groups) != num_groups:
        raise CheckpointError(f"{names[0]}: {len(saved_groups)} optimizer param groups for {num_groups} groups")
    result.groups = [{k: v for k, v in group.items() if k != "params"} for group in saved_groups]
    for g in range(num_groups):
        numel = first["group_part_numel"][g]
        entries = [e for e in first["params"] if e["group"] == g]
        for key, value in _group_state(payloads[0], g).items():
            partitioned = key != STEP_KEY and torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel
            for entry in entries:
                st = result.state.setdefault(entry["name"], {})
                if partitioned and entry.get("expert"):
                    continue  # per element, from the expert states files; the group's scalars (step) stay
                if partitioned:
                    parts = []
                    for payload, name in zip(payloads, names):
                        part = _group_state(payload, g).get(key)
                        if not torch.is_tensor(part) or part.numel() != numel:
                            raise CheckpointError(f"{name}: optimizer state '{key}' of param group {g} is missing "
                                                  f"or not a partition of {numel} elements")
                        parts.append(part)
                    st[key] = _full_value(parts, entry, value.dtype)
                else:
                    st[key] = value.clone() if torch.is_tensor(value) else value
    return result, frozen
