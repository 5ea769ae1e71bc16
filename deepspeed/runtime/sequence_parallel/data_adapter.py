# SPDX-License-Identifier: Apache-2.0
"""The data side of Ulysses sequence parallelism: every rank of a group gets its own shard of the same samples.

Each rank's data loader yields its own batches (as under data parallelism). One refill takes one batch from every
rank of the sequence-parallel group, and the adapter then yields ``P`` micro-batches in turn: the ``j``-th is the
batch of group rank ``j``, of which this rank holds sequence shard ``r`` (its group rank). So the group works on
one rank's samples at a time, all ranks on the same samples, each on its own tokens; over ``P`` micro-batches
every sample of the group is seen once, every token by exactly one rank.

Labels. A causal LM predicts token ``t + 1`` at position ``t``, so the label of a shard's last position is the
first token of the next shard. The adapter therefore shifts the labels of the *whole* sample before cutting it
(``shift_labels[t] = labels[t + 1]``, ``-100`` after the end) and removes ``labels``: a shard's loss needs nothing
from its neighbour.

Lengths. Samples may change length from batch to batch and from rank to rank. A batch whose length does not divide
by ``P`` is padded at the end to the next multiple: ``input_ids`` with 0, ``shift_labels`` with -100 (so the padding
carries no loss), ``position_ids`` continuing the count, ``attention_mask`` with 0, other tensors with 0. Padding at
the end of a causal sequence changes nothing before it.

Every rank checks the group's batches against the same gathered description (keys, batch sizes, shapes) and raises
the same ``ValueError`` on a mismatch; a loader that runs out on any rank ends the epoch on every rank.
"""

from collections import deque
from typing import Any, Dict, List

import torch

import deepspeed.comm as dist

__all__ = ["UlyssesSPDataLoaderAdapter"]

_PAD_VALUE = {"input_ids": 0, "shift_labels": -100, "labels": -100, "attention_mask": 0}


class UlyssesSPDataLoaderAdapter:
    """Wrap ``dl`` (yielding dicts of ``[batch, seq, ...]`` tensors with ``input_ids``, ``position_ids`` and
    ``labels``; other entries are carried along) to yield this rank's sequence shards.

    ``sp_rank``/``sp_world_size``: this rank's position in and the size of ``sp_group``; ``device``: where the
    exchange runs (the collectives' device). Yielded tensors are on the host, as upstream's; ``len()`` is
    ``len(dl) * sp_world_size``. Non-tensor entries come from the sample's source rank unchanged.
    """

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size: int, device):
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        return self

    def __next__(self) -> Dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    # --------------------------------------------------------------------------------------------------------------
    def _next_local(self):
        try:
            return next(self.iter)
        except StopIteration:
            return None

    def refill(self) -> None:
        """Take one batch from every group rank and queue this rank's shard of each, in group-rank order."""
        batch = self._next_local()
        described = self._describe(batch)
        group_descriptions: List[Any] = [None] * self.sp_world_size
        dist.all_gather_object(group_descriptions, described, group=self.sp_group)
        if any(d is None for d in group_descriptions):
            self.iter = iter(self.dl)  # the next epoch starts afresh on every rank
            raise StopIteration
        self._check(group_descriptions)
        keys = group_descriptions[0]["keys"]
        gathered: Dict[str, List[Any]] = {}
        for key in keys:
            gathered[key] = self._gather_entry(batch[key], key, group_descriptions)
        for source in range(self.sp_world_size):
            sample = {key: gathered[key][source] for key in keys}
            self.micro_batches.append(self._shard(sample))

    def _describe(self, batch):
        if batch is None:
            return None
        if not isinstance(batch, dict):
            raise ValueError(f"UlyssesSPDataLoaderAdapter: the data loader must yield dicts, got {type(batch)}")
        entries = {}
        for key, value in batch.items():
            if torch.is_tensor(value):
                entries[key] = ("tensor", tuple(value.shape), str(value.dtype))
            else:
                entries[key] = ("object", None, None)
        return {"keys": list(batch.keys()), "entries": entries}

    def _check(self, descriptions) -> None:
        first = descriptions[0]
        for rank, d in enumerate(descriptions):
            if sorted(d["keys"]) != sorted(first["keys"]):
                raise ValueError(f"UlyssesSPDataLoaderAdapter: group rank {rank}'s batch has keys {d['keys']}, "
                                 f"group rank 0's has {first['keys']}")
            for key in ("input_ids", "position_ids", "labels"):
                if key not in d["entries"]:
                    raise ValueError(f"UlyssesSPDataLoaderAdapter: every batch needs '{key}' (group rank {rank}'s "
                                     f"has {d['keys']}); position_ids keep each token's global position once the "
                                     f"sequence is cut (for unpacked samples: arange(seq_len) per row)")
            seq = d["entries"]["input_ids"][1]
            for key, (kind, shape, dtype) in d["entries"].items():
                if kind != "tensor":
                    continue
                if len(shape) < 2 or shape[:2] != seq[:2]:
                    raise ValueError(f"UlyssesSPDataLoaderAdapter: '{key}' has shape {shape} on group rank {rank}; "
                                     f"every tensor must be [batch, seq, ...] like input_ids {seq}")
                if dtype != first["entries"][key][2] or shape[2:] != first["entries"][key][1][2:]:
                    raise ValueError(f"UlyssesSPDataLoaderAdapter: '{key}' differs in dtype or trailing shape "
                                     f"between group ranks 0 and {rank}")

    def _gather_entry(self, value, key, descriptions) -> List[Any]:
        kind = descriptions[0]["entries"][key][0]
        if kind == "object":
            objects: List[Any] = [None] * self.sp_world_size
            dist.all_gather_object(objects, value, group=self.sp_group)
            return objects
        shapes = [d["entries"][key][1] for d in descriptions]
        max_batch = max(s[0] for s in shapes)
        max_seq = max(s[1] for s in shapes)
        # all_gather needs equal shapes: pad to the group's largest, cut back afterwards.
        local = value.to(self.device)
        padded = local.new_zeros((max_batch, max_seq) + tuple(local.shape[2:]))
        padded[:local.shape[0], :local.shape[1]] = local
        pieces = [torch.empty_like(padded) for _ in range(self.sp_world_size)]
        with torch.no_grad():
            dist.all_gather(pieces, padded, group=self.sp_group)
        return [piece[:s[0], :s[1]] for piece, s in zip(pieces, shapes)]

    def _shard(self, sample: Dict[str, Any]) -> Dict[str, Any]:
        labels = sample.pop("labels")
        shifted = torch.full_like(labels, -100)
        shifted[:, :-1] = labels[:, 1:]
        sample["shift_labels"] = shifted
        seq = sample["input_ids"].shape[1]
        padded_seq = -(-seq // self.sp_world_size) * self.sp_world_size
        chunk = padded_seq // self.sp_world_size
        begin, end = chunk * self.sp_rank, chunk * (self.sp_rank + 1)
        out = {}
        for key, value in sample.items():
            if not torch.is_tensor(value):
                out[key] = value
                continue
            if padded_seq != seq:
                value = _pad_sequence(value, key, padded_seq)
            out[key] = value[:, begin:end].contiguous().cpu()
        return out


def _pad_sequence(value: torch.Tensor, key: str, length: int) -> torch.Tensor:
    seq = value.shape[1]
    if key == "position_ids":
        steps = torch.arange(1, length - seq + 1, dtype=value.dtype, device=value.device)
        tail = value[:, -1:] + steps
    else:
        tail = value.new_full((value.shape[0], length - seq) + tuple(value.shape[2:]), _PAD_VALUE.get(key, 0))
    return torch.cat([value, tail], dim=1)
