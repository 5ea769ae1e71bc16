# SPDX-License-Identifier: Apache-2.0
"""Checkpoints of expert parameters: upstream's per-expert file layout, and an exact resume.

Different expert-parallel ranks hold different experts under the same parameter names, so the
model-states file (written by rank 0) cannot hold them. Beside the stage's files, in
``<save_dir>/<tag>/``:

* ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt`` for every MoE layer ``L`` (the ``L``-th
  ``deepspeed.moe.layer.MoE`` or AutoEP block in module order) and every global expert ``E``:
  that expert's parameters in the model's dtype, keyed by their full names with the local expert
  index replaced by the global one (``...deepspeed_experts.<E>.<name>``; AutoEP's stacked
  weights as ``...experts.<name>.<E>``), as upstream lays them out. The first rank of each
  expert-data-parallel group writes them;
* ``expp_rank_{R}_mp_rank_00_expert_states.pt`` for every expert-parallel rank ``R``: the fp32
  values and the optimizer state (every tensor the size of the parameter) of that rank's expert
  parameters, and the expert-parallel sizes it was saved with.

Loading (after the stage's own load): every rank reads its experts' files and its
expert-parallel rank's states file and sets the module values, the fp32 masters and the
optimizer state, so a resume continues exactly.

Onto another expert-parallel size (a checkpoint of ZeRO 1, 2 or 3; resharding), and between ZeRO-3 and
another stage when experts are of expert-parallel size > 1: the module's expert
entries are replaced by this rank's new experts read from the per-expert files
(:func:`local_module_values`), the stage's partitions give the dense parameters by name (expert
buckets, and ZeRO-3's experts sharded over their own group, are skipped: ``checkpoint/reshard.py``,
``checkpoint/stage3_state.py``), and :func:`add_local_experts` adds this rank's
experts to that by-name state from every expert states file, indexed by global expert (fp32 values
and per-element optimizer state; the group's scalars such as ``step`` from the saved group). The
stage then cuts it into its own layout, so the next steps equal the continued run's.
``load_module_only=True`` loads the experts' module values and refreshes the masters. A ZeRO-0
checkpoint (its optimizer state lives in rank 0's model-states file, with rank 0's experts only)
loads onto another size only with ``load_module_only``.
"""

import os
import re

import torch

import deepspeed.comm as dist
from deepspeed.moe.utils import is_moe_param
from deepspeed.utils import groups

EXPERT_FILE = "layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt"
STATES_FILE = "expp_rank_{rank}_mp_rank_00_expert_states.pt"


def _layers(module):
    """``[(layer id, prefix, expert module kind, module)]`` of the model's expert layers, in module order."""
    from deepspeed.moe.autoep import GroupedExperts
    from deepspeed.moe.experts import Experts
    out = []
    for name, sub in module.named_modules():
        if isinstance(sub, (Experts, GroupedExperts)):
            out.append((len(out), name, sub))
    return out


def _ep_rank(experts):
    size = _ep_size(experts)
    return groups._get_expert_parallel_rank(groups.expert_group_name(size)) if size > 1 else 0


def _ep_size(experts):
    from deepspeed.moe.autoep import GroupedExperts
    if isinstance(experts, GroupedExperts):
        return experts.ep_size
    param = next(experts.parameters())
    return int(param.group_name[len(groups.EXPERT_GROUP_PREFIX):])


def _local_entries(prefix, experts):
    """``[(global expert, {file key: parameter or (parameter, row)})]`` of this rank's experts of one layer."""
    from deepspeed.moe.autoep import GroupedExperts
    out = []
    if isinstance(experts, GroupedExperts):
        for local in range(experts.num_local_experts):
            e = experts.first_expert + local
            out.append((e, {f"{prefix}.{n}.{e}": (p, local) for n, p in experts.named_parameters(recurse=False)}))
        return out
    first = _ep_rank(experts) * experts.num_local_experts
    for local, expert in enumerate(experts.deepspeed_experts):
        e = first + local
        out.append((e, {f"{prefix}.deepspeed_experts.{e}.{n}": (p, None) for n, p in expert.named_parameters()}))
    return out


def _is_writer(experts):
    """The first rank of this layer's expert-data-parallel group writes its experts' files."""
    name = groups.expert_group_name(_ep_size(experts))
    return groups._get_expert_data_parallel_rank(name) == 0 if dist.is_initialized() else True


def has_experts(engine):
    return any(is_moe_param(p) for p in engine.module.parameters())


def _state_keys(stage, param):
    """The optimizer-state keys of ``param`` that hold one value per element (exp_avg, ...)."""
    probe = []
    for key in ("exp_avg", "exp_avg_sq", "momentum_buffer", "sum", "max_exp_avg_sq"):
        try:
            value = stage.optimizer_state(param, key)
        except KeyError:
            value = None
        if isinstance(value, torch.Tensor) and value.numel() == getattr(param, "ds_numel", param.numel()):
            probe.append(key)
    return probe


def write_files(engine, writer, directory):
    """Write this rank's expert files (see the module docstring; collective: every rank calls it)."""
    if not has_experts(engine):
        return
    stage = engine._stage
    names = {id(p): n for n, p in engine.module.named_parameters()}
    states = {}
    files = []
    layers = _layers(engine.module)
    for layer, prefix, experts in layers:
        full = {id(p): _full(stage, p) for p in experts.parameters()}  # one gather per parameter (ZeRO-3)
        for e, entries in _local_entries(prefix, experts):
            values = {
                key: (full[id(param)][row] if row is not None else full[id(param)]).clone().cpu()
                for key, (param, row) in entries.items()
            }
            if _is_writer(experts):
                files.append((EXPERT_FILE.format(layer=layer, expert=e), values))
        if stage is not None:
            for param in experts.parameters():  # gathers (stages 1, 2) are collectives over the group
                states[names[id(param)]] = dict(fp32=stage.fp32_param(param).detach().float().clone().cpu(),
                                                state={
                                                    k: stage.optimizer_state(param, k).detach().clone().cpu()
                                                    for k in _state_keys(stage, param)
                                                })
    if all(_is_writer(x) for _, _, x in layers):
        payload = dict(ep_sizes=[_ep_size(x) for _, _, x in layers], params=states)
        files.append((STATES_FILE.format(rank=_ep_rank(layers[0][2])), payload))
    for name, payload in files:
        writer.save(payload, os.path.join(directory, name))


def _full(stage, param):
    """The whole value of ``param`` in the model's dtype (ZeRO-3: gathered from the fp32 masters, a collective)."""
    if hasattr(param, "ds_tensor") and stage is not None:
        return stage.fp32_param(param).detach().to(param.dtype)
    return param.detach()


def check_load(engine, load_dir, tag, load_module_only, load_optimizer_states, load_module_strict):
    """Raise (every rank, before the load reads or changes anything) when the checkpoint's expert layout
    cannot be loaded as asked; nothing when there is nothing to load or no expert."""
    from deepspeed.runtime.checkpoint.paths import tag_dir
    from deepspeed.runtime.checkpoint.reader import resolve_tag
    from deepspeed.runtime.checkpoint.validate import CheckpointError
    if not has_experts(engine) or not isinstance(load_dir, (str, os.PathLike)) or not os.path.isdir(load_dir):
        return
    tag, _ = resolve_tag(load_dir, tag)
    directory = tag_dir(load_dir, tag) if tag is not None else None
    if directory is None or not os.path.isdir(directory):
        return
    if _upstream_autoep(directory):
        return  # upstream's AutoEP layout: the reader gives every expert by name (checkpoint/upstream_autoep.py)
    mine = [_ep_size(x) for _, _, x in _layers(engine.module)]
    found = sorted(f for f in os.listdir(directory) if re.fullmatch(r"expp_rank_\d+_mp_rank_00_expert_states\.pt", f))
    if not found:
        raise CheckpointError(f"{directory}: no expert states file (expp_rank_*_mp_rank_00_expert_states.pt); the "
                              f"checkpoint was not saved by an engine with expert parameters")
    saved = torch.load(os.path.join(directory, found[0]), map_location="cpu", weights_only=False)["ep_sizes"]
    if saved == mine:
        return
    if len(saved) != len(mine):
        raise CheckpointError(f"{directory}: saved with {len(saved)} expert layers, this engine has {len(mine)}")
    if len(set(saved)) > 1:
        raise CheckpointError(f"{directory}: saved with expert-parallel sizes {saved}; resharding needs one size "
                              f"for every expert layer")
    if not load_module_only and load_optimizer_states and _saved_stage(directory) not in (1, 2, 3):
        raise CheckpointError(f"{directory}: saved with expert-parallel sizes {saved}, this engine has {mine}; a "
                              f"ZeRO stage {_saved_stage(directory)} checkpoint holds the optimizer state of rank 0's "
                              f"experts only. Load with load_module_only=True (the fp32 masters follow the module)")


def _rank0_model_states(directory):
    """Rank 0's model-states file of ``directory`` (stages 0-2: the one file; stage 3: every rank writes its own),
    loaded, or None."""
    from deepspeed.runtime.checkpoint import paths
    for name in (paths.model_states_name(0), paths.zero3_model_states_name(0)):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return torch.load(path, map_location="cpu", weights_only=False)
    return None


def _upstream_autoep(directory):
    """Whether ``directory`` holds upstream's AutoEP checkpoint (read by ``checkpoint/upstream_autoep.py``)."""
    from deepspeed.checkpoint.upstream_autoep import is_autoep
    from deepspeed.runtime.checkpoint.reader import META_KEY
    ckpt = _rank0_model_states(directory)
    return ckpt is not None and META_KEY not in ckpt and is_autoep(ckpt)


def localize_global_experts(engine, values):
    """``values`` (name -> tensor, or name -> {key: tensor}) with every AutoEP expert entry that holds all the
    experts (an upstream checkpoint's, stacked in global order) cut to this rank's rows. In place; returns it."""
    from deepspeed.moe.autoep import GroupedExperts
    for _, prefix, experts in _layers(engine.module):
        if not isinstance(experts, GroupedExperts) or experts.num_local_experts == experts.num_experts:
            continue
        rows = slice(experts.first_expert, experts.first_expert + experts.num_local_experts)
        for rest, _ in experts.named_parameters(recurse=False):
            name = f"{prefix}.{rest}"
            value = values.get(name)
            if isinstance(value, dict):
                values[name] = {
                    k: (v[rows] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == experts.num_experts else v)
                    for k, v in value.items()
                }
            elif isinstance(value, tuple):  # a shape
                if value and value[0] == experts.num_experts:
                    values[name] = (experts.num_local_experts, ) + tuple(value[1:])
            elif torch.is_tensor(value) and value.shape[0] == experts.num_experts:
                values[name] = value[rows]
    return values


def _saved_stage(directory):
    """The ZeRO stage that wrote ``directory`` (from rank 0's model-states file), or None."""
    from deepspeed.runtime.checkpoint.reader import META_KEY
    ckpt = _rank0_model_states(directory)
    if ckpt is None:
        return None
    return (ckpt.get(META_KEY) or {}).get("zero_stage", 0 if ckpt.get("optimizer") is not None else None)


def resharding(engine, directory):
    """Whether ``directory`` was saved with other expert-parallel sizes than ``engine`` has (checked by
    :func:`check_load`), or experts of size > 1 cross between ZeRO-3 and another stage (ZeRO-3 shards them over
    their expert-data-parallel group: the partitions of one layout give no expert to the other; the per-expert
    files do)."""
    if not has_experts(engine) or directory is None:
        return False
    if _upstream_autoep(directory):
        return True
    path = os.path.join(directory, STATES_FILE.format(rank=0))
    if not os.path.exists(path):
        return False
    saved = torch.load(path, map_location="cpu", weights_only=False)["ep_sizes"]
    if saved != [_ep_size(x) for _, _, x in _layers(engine.module)]:
        return True
    return max(saved, default=1) > 1 and (_saved_stage(directory) == 3) != (_stage_of(engine) == 3)


def _stage_of(engine):
    stage = getattr(engine, "_stage", None)
    return getattr(stage, "stage", None) if stage is not None else None


def _my_expert_values(engine, directory):
    """name -> this rank's value of every expert parameter, from the per-expert files (model dtype)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = {}
    for layer, prefix, experts in _layers(engine.module):
        for e, entries in _local_entries(prefix, experts):
            values = torch.load(os.path.join(directory, EXPERT_FILE.format(layer=layer, expert=e)),
                                map_location="cpu",
                                weights_only=False)
            for key, (param, row) in entries.items():
                name = names[id(param)]
                if row is None:
                    out[name] = values[key]
                else:
                    out.setdefault(name, torch.empty(getattr(param, "ds_shape", param.shape),
                                                     dtype=values[key].dtype))[row].copy_(values[key])
    return out


def local_module_values(engine, directory, values, shapes):
    """``(values, shapes)`` of the saved module with every expert entry replaced by this rank's experts at the
    engine's expert-parallel size (read from the per-expert files)."""
    prefixes = tuple(prefix + "." for _, prefix, _ in _layers(engine.module))
    values = {k: v for k, v in values.items() if not k.startswith(prefixes)}
    shapes = {k: v for k, v in shapes.items() if not k.startswith(prefixes)}
    mine = _my_expert_values(engine, directory)
    values.update(mine)
    shapes.update((k, tuple(v.shape)) for k, v in mine.items())
    return values, shapes


def _global_states(engine, directory):
    """``{(layer prefix, global expert, parameter name within the expert): (fp32, {state key: tensor})}`` from
    every expert states file of ``directory``."""
    from deepspeed.moe.autoep import GroupedExperts
    layers = {prefix: experts for _, prefix, experts in _layers(engine.module)}
    table = {}
    rank = 0
    while os.path.exists(os.path.join(directory, STATES_FILE.format(rank=rank))):
        payload = torch.load(os.path.join(directory, STATES_FILE.format(rank=rank)),
                             map_location="cpu",
                             weights_only=False)
        for prefix, experts in layers.items():
            entries = {n[len(prefix) + 1:]: v for n, v in payload["params"].items() if n.startswith(prefix + ".")}
            if isinstance(experts, GroupedExperts):
                for rest, entry in entries.items():
                    local = entry["fp32"].shape[0]
                    for row in range(local):
                        table[(prefix, rank * local + row, rest)] = (entry["fp32"][row], {
                            k: v[row]
                            for k, v in entry["state"].items()
                        })
            else:  # deepspeed_experts.<local>.<name>
                parsed = [(int(rest.split(".")[1]), rest.split(".", 2)[2], entry) for rest, entry in entries.items()]
                local = 1 + max((i for i, _, _ in parsed), default=-1)
                for i, name, entry in parsed:
                    table[(prefix, rank * local + i, name)] = (entry["fp32"], entry["state"])
        rank += 1
    return table


def add_local_experts(engine, directory, full, with_state):
    """Put this rank's expert parameters into ``full`` (a ``FullState`` by name whose expert entries were left out):
    fp32 values and per-element optimizer state from every expert states file by global expert, the param group's
    scalar state (``step``...) from the saved group. Returns ``full``."""
    from deepspeed.moe.autoep import GroupedExperts
    table = _global_states(engine, directory)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    stage = engine._stage
    for _, prefix, experts in _layers(engine.module):
        if isinstance(experts, GroupedExperts):
            for rest, param in experts.named_parameters(recurse=False):
                rows = [table[(prefix, experts.first_expert + i, rest)] for i in range(experts.num_local_experts)]
                _put(full, names[id(param)], torch.stack([r[0] for r in rows]),
                     {k: torch.stack([r[1][k] for r in rows])
                      for k in rows[0][1]}, stage, param, with_state)
            continue
        first = _ep_rank(experts) * experts.num_local_experts
        for local, expert in enumerate(experts.deepspeed_experts):
            for rest, param in expert.named_parameters():
                fp32, state = table[(prefix, first + local, rest)]
                _put(full, names[id(param)], fp32, state, stage, param, with_state)
    return full


def _put(full, name, fp32, state, stage, param, with_state):
    full.fp32[name] = fp32.float()
    if not with_state:
        return
    group = stage._group(param) if hasattr(stage, "_group") else None
    scalars = {}
    if group is not None and group < len(full.group_names):
        for other in full.group_names[group]:
            if other in full.state:
                scalars = {k: v for k, v in full.state[other].items() if k not in state}
                break
    full.state[name] = {**scalars, **{k: v.clone() for k, v in state.items()}}


@torch.no_grad()
def load_files(engine, directory, load_module_only, load_optimizer_states, resharded=False):
    """Set this rank's experts from the checkpoint (see the module docstring); local, no collective.

    Runs after the stage's own load (which gave every rank rank 0's experts).
    """
    if not has_experts(engine) or resharded:  # resharded: the module and the by-name state held this rank's experts
        return
    if any(hasattr(p, "ds_tensor") for p in engine.module.parameters()):
        return  # ZeRO-3 (expert-parallel size 1): the stage's own files hold every expert, sharded like the rest
    stage = engine._stage
    layers = _layers(engine.module)
    module_values = []  # (the module's tensor, the value its file holds)
    for layer, prefix, experts in layers:
        for e, entries in _local_entries(prefix, experts):
            values = torch.load(os.path.join(directory, EXPERT_FILE.format(layer=layer, expert=e)),
                                map_location="cpu",
                                weights_only=False)
            for key, (param, row) in entries.items():
                target = param.data[row] if row is not None else param.data
                target.copy_(values[key].to(target.dtype))
                module_values.append((target, values[key]))
    if stage is None:
        return
    path = os.path.join(directory, STATES_FILE.format(rank=_ep_rank(layers[0][2])))
    saved = torch.load(path, map_location="cpu", weights_only=False) if os.path.exists(path) else None
    exact = (saved is not None and saved["ep_sizes"] == [_ep_size(x) for _, _, x in layers] and not load_module_only)
    for name, param in engine.module.named_parameters():
        if not is_moe_param(param):
            continue
        entry = saved["params"].get(name) if exact else None
        if entry is None:  # another layout, or the module only: the masters follow the module values
            stage.set_fp32_param(param, param.detach().float())
            continue
        stage.set_fp32_param(param, entry["fp32"].to(param.device))
        if load_optimizer_states:
            for key, value in entry["state"].items():
                stage.set_optimizer_state(param, key, value.to(param.device))
    if exact:
        # set_fp32_param wrote the masters into the module too; the model's values may differ from them (ZenFlow:
        # a host step not applied yet), and the files hold the model's
        for target, value in module_values:
            target.copy_(value.to(target.dtype))
