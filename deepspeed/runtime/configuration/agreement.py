# SPDX-License-Identifier: Apache-2.0
"""Every rank agrees on the config and the model before the engine's first collective.

A rank with another ``gradient_accumulation_steps`` or ZeRO stage, or a model whose parameters differ,
does not fail by itself: it issues other collectives than its peers, so one rank blocks until the other
exits, or gloo aborts on mismatched sizes. :func:`check_ranks_agree` runs first in the engine's
construction, before the model broadcast: each rank sends a small fingerprint of what the collectives
depend on, every rank compares all of them the same way, and every rank raises the same error naming the
first field that differs and which ranks hold which value.

The fingerprint is one all-gather of a few hundred bytes, whatever the model: the parameter list
(names, shapes -- ``ds_shape`` for ZeRO-3 parameters built in ``zero.Init`` -- and trainable flags) and
the buffer list travel as counts and digests. Only when those differ do two more exchanges find the first
differing entry: digests of chunks of :data:`CHUNK` entries, then the entries of the first differing chunk.
With world size 1 nothing is exchanged.
"""

import hashlib
import json

import torch

import deepspeed.comm as dist
from deepspeed.runtime.config_utils import DeepSpeedConfigError
from deepspeed.runtime.swap_tensor.swap_folder import nvme_path_verdict

CHUNK = 256  # entries per chunk digest when locating the first differing parameter


def check_ranks_agree(config, model, has_optimizer, device, model_key=0):
    """Raise on every rank if the ranks' configs or models differ (a collective: every rank calls it).

    ``config`` is this rank's :class:`DeepSpeedConfig`, ``model`` the module given to ``initialize``,
    ``has_optimizer`` whether an optimizer (client or config) was given, ``device`` where the
    exchange's tensors live (the engine's device). Models are compared among the ranks with the same
    ``model_key`` (a pipeline stage: each stage holds its own layers). Raises ``DeepSpeedConfigError``
    for a config field, ``ValueError`` for the model.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    params = _parameter_entries(model)
    buffers = [[name, list(buf.shape)] for name, buf in model.named_buffers()]
    mine = config_fingerprint(config, has_optimizer)
    mine["model parameters"] = _digest(params)
    mine["model buffers"] = _digest(buffers)
    fields = list(mine)
    # Only the values travel: every rank builds the fields in the same order.
    everyone = _all_gather_json([model_key] + list(mine.values()), device)
    keys = [rank_values[0] for rank_values in everyone]
    for index, field in enumerate(fields):
        values = [rank_values[index + 1] for rank_values in everyone]
        if field in ("model parameters", "model buffers"):
            if all(values[r] == values[keys.index(keys[r])] for r in range(len(values))):
                continue
            kind, entries = ("parameter", params) if field == "model parameters" else ("buffer", buffers)
            raise ValueError(_describe_entries(kind, entries, device, keys))
        if all(value == values[0] for value in values):
            continue
        raise DeepSpeedConfigError(f"deepspeed.initialize: the ranks disagree on {field}: {_by_rank(values)}. Every "
                                   f"rank must use the same config and the same model; stopping before the first "
                                   f"collective, which would hang or abort.")


def config_fingerprint(config, has_optimizer):
    """The config fields the engine's collectives depend on, in the order they are compared (JSON values)."""
    zero = config.zero_config

    def name(value):
        return None if value is None else str(getattr(value, "value", value))

    precision = "bf16" if config.bfloat16_enabled else "fp16" if config.fp16_enabled else "fp32"
    return {
        "config key 'zero_optimization.stage'": int(config.zero_optimization_stage),
        "config key 'gradient_accumulation_steps'": config.gradient_accumulation_steps,
        "config key 'train_micro_batch_size_per_gpu'": config.train_micro_batch_size_per_gpu,
        "config key 'train_batch_size'": config.train_batch_size,
        "the precision (config 'fp16'/'bf16' sections)": precision,
        "config key 'data_types.grad_accum_dtype'": name(config.grad_accum_dtype),
        "config key 'communication_data_type'": name(config.communication_data_type),
        "config key 'gradient_allreduce_op'": config.gradient_allreduce_op,
        "config key 'managed_gradient_accumulation'": bool(config.managed_gradient_accumulation),
        "config key 'zero_optimization.offload_optimizer.device'": name(zero.offload_optimizer_device),
        "config key 'zero_optimization.offload_param.device'": name(zero.offload_param_device),
        "config key 'zero_optimization.reduce_bucket_size'": int(zero.reduce_bucket_size),
        "config key 'zero_optimization.overlap_comm'": bool(zero.overlap_comm),
        "config key 'zero_optimization.reduce_scatter'": bool(zero.reduce_scatter),
        "config key 'zero_optimization.stage3_prefetch_bucket_size'": int(zero.stage3_prefetch_bucket_size),
        "config key 'zero_optimization.stage3_param_persistence_threshold'":
        int(zero.stage3_param_persistence_threshold),
        "config key 'gradient_clipping'": float(config.gradient_clipping),
        "config key 'optimizer.type'": config.optimizer_name,
        "whether an optimizer was given (client or config)": bool(has_optimizer),
        # a folder one rank cannot use would fail its stage's construction alone, after the others went on
        "whether each rank can use its NVMe offload folder (config key 'nvme_path')": nvme_path_verdict(zero),
    }


def _parameter_entries(model):
    entries = []
    for pname, param in model.named_parameters():
        shape = getattr(param, "ds_shape", None)
        shape = list(param.shape if shape is None else shape)
        entries.append([pname, shape, bool(param.requires_grad)])
    return entries


def _digest(entries):
    text = json.dumps(entries, separators=(",", ":")).encode()
    return [len(entries), hashlib.sha256(text).hexdigest()]


def _all_gather_json(obj, device):
    """Every rank's ``obj`` (JSON-serialisable), in rank order, through two small all-gathers on ``device``.

    Tensors on the engine's device rather than ``all_gather_object``, which picks the current CUDA
    device and so depends on whether the script set it.
    """
    payload = torch.frombuffer(bytearray(json.dumps(obj, sort_keys=False).encode()), dtype=torch.uint8)
    world = dist.get_world_size()
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(lengths, length)
    lengths = lengths.tolist()
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:payload.numel()] = payload.to(device)
    gathered = torch.empty(world * longest, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(gathered, padded)
    rows = gathered.cpu().view(world, longest)
    return [json.loads(bytes(rows[r, :lengths[r]].tolist()).decode()) for r in range(world)]


def _describe_entries(kind, entries, device, keys=None):
    """Find the first entry whose value differs across ranks of one model key (two exchanges of bounded size);
    describe it."""
    chunks = [_digest(entries[i:i + CHUNK])[1] for i in range(0, len(entries), CHUNK)]
    everyone = _all_gather_json({"count": len(entries), "chunks": chunks}, device)
    members = list(range(len(everyone)))
    if keys is not None:  # the first model key whose ranks disagree (every rank finds the same one)
        for key in dict.fromkeys(keys):
            group = [r for r, k in enumerate(keys) if k == key]
            if any(everyone[r] != everyone[group[0]] for r in group):
                members = group
                break
    everyone = [everyone[r] for r in members]
    counts = [rank["count"] for rank in everyone]
    common = min(len(rank["chunks"]) for rank in everyone)
    # The first chunk whose digests differ; if every common chunk agrees, the lists differ in length and the
    # first difference is right after the shortest list's last full chunk.
    first = next((c for c in range(common) if len({rank["chunks"][c] for rank in everyone}) > 1), common)
    start = first * CHUNK
    window = _all_gather_json(entries[start:start + CHUNK], device)
    window = [window[r] for r in members]
    for offset in range(CHUNK):
        values = [_entry_text(kind, rank_entries, offset) for rank_entries in window]
        if len(set(values)) > 1:
            return (f"deepspeed.initialize: the ranks' models differ at {kind} #{start + offset}: "
                    f"{_by_rank(values, members)} (number of {kind}s: {_by_rank(counts, members)}). Every rank "
                    f"must build the same model; stopping before the first collective, which would abort on "
                    f"mismatched sizes.")
    return (f"deepspeed.initialize: the ranks' models differ in their {kind}s (number of {kind}s: "
            f"{_by_rank(counts, members)})")


def _entry_text(kind, entries, offset):
    if offset >= len(entries):
        return f"no {kind}"
    entry = entries[offset]
    text = f"'{entry[0]}' of shape {tuple(entry[1])}"
    if len(entry) > 2:
        text += " trainable" if entry[2] else " frozen"
    return text


def _by_rank(values, ranks=None):
    """``"1 on rank 0, 2 on ranks [1, 3]"``: each distinct value with the ranks that hold it (``values[i]`` is
    rank ``ranks[i]``'s, default ``i``)."""
    groups = {}
    for i, value in enumerate(values):
        rank = ranks[i] if ranks is not None else i
        groups.setdefault(value if isinstance(value, str) else repr(value), []).append(rank)
    return ", ".join(f"{value} on " + (f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}")
                     for value, ranks in groups.items())
