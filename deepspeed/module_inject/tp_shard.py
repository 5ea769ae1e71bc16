# SPDX-License-Identifier: Apache-2.0
"""How a dimension is cut over the tensor-parallel ranks (upstream's module and names).

:func:`get_shard_size_list` gives every rank's width of a dimension of ``total_size``:

* attention dimensions (a multiple of the key/value head count, set by :func:`set_num_kv_heads`,
  for a layer whose name is not an MLP's nor the LM head's) are cut at whole key/value head
  groups: rank ``r`` gets ``kv // tp`` groups, one more for the first ``kv % tp`` ranks, and the
  query heads of those groups (6 key/value heads over 4 ranks: 2, 2, 1, 1);
* anything else is cut as evenly as possible in units of ``tp_grain_size`` elements, the first
  ranks taking one more unit (a vocabulary of 65 over 2 ranks: 33, 32).

The globals are set by the sharding from the model's config before any layer is cut; the cut
of each parameter is then frozen in its :class:`~deepspeed.module_inject.layers.ShardLayout`.
"""

from deepspeed import comm as dist

num_kv_heads = None
num_attention_heads = None
n_embd = None
tp_grain_size = 1

_LAST_LINEAR = ("lm_head", "embed_out")
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def set_num_kv_heads(num):
    global num_kv_heads
    num_kv_heads = num


def set_num_attention_heads(num):
    global num_attention_heads
    num_attention_heads = num


def set_n_embd(num):
    global n_embd
    n_embd = num


def set_tp_grain_size(num):
    global tp_grain_size
    tp_grain_size = max(1, int(num))


def get_num_kv_heads():
    return num_kv_heads


def get_num_attention_heads():
    return num_attention_heads


def _head_aligned(total_size, name, kv_heads):
    if kv_heads is None or kv_heads < 1 or total_size % kv_heads != 0:
        return False
    name = str(name)
    if "mlp" in name or any(s in name for s in _MLP_NAMES):
        return False
    return name.split(".")[-1] not in _LAST_LINEAR and name not in _LAST_LINEAR


def get_shard_size_list(total_size, mp_size, name=None, num_kv_heads=None):
    """Every rank's width of a dimension of ``total_size`` cut over ``mp_size`` ranks (module docstring)."""
    total_size, mp_size = int(total_size), int(mp_size)
    kv = globals()["num_kv_heads"] if num_kv_heads is None else num_kv_heads
    if _head_aligned(total_size, name, kv):
        per_head = total_size // kv
        return [((kv // mp_size) + (1 if r < kv % mp_size else 0)) * per_head for r in range(mp_size)]
    grain = tp_grain_size if total_size >= tp_grain_size else 1
    units = total_size // grain
    widths = [(units // mp_size + (1 if r < units % mp_size else 0)) * grain for r in range(mp_size)]
    widths[-1] += total_size - units * grain  # a remainder below one grain goes to the last rank
    return widths


def get_shard_size(total_size, mp_size, name=None, rank=None, mp_group=None, num_kv_heads=None):
    """Rank ``rank``'s width (its index in the tensor-parallel group; default: this rank's in ``mp_group``)."""
    if rank is None:
        if mp_group is not None:
            rank = dist.get_rank(group=mp_group)
        else:
            world = dist.get_world_size() if dist.is_initialized() else 1
            if world != mp_size:
                raise ValueError(f"get_shard_size needs the rank within the tensor-parallel group (or mp_group) when "
                                 f"mp_size ({mp_size}) differs from the world size ({world})")
            rank = dist.get_rank() if dist.is_initialized() else 0
    return get_shard_size_list(total_size, mp_size, name, num_kv_heads)[rank]
