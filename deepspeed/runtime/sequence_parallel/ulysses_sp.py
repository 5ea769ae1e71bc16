# SPDX-License-Identifier: Apache-2.0
"""Ulysses sequence parallelism for HF Transformers models, and the ALST memory tools (Arctic Long Sequence
Training).

* :class:`UlyssesSPAttentionHF` wraps one of Transformers' core attention functions (``sdpa``, flash attention):
  the query, key and value of a sequence shard are exchanged (all-to-all) so that each rank attends over the whole
  sequence for ``1/P`` of the heads, and the context is exchanged back. ``register_with_transformers`` installs it
  under the core implementation's own name, so every code path of the model that tests for that name still runs,
  and returns the ``mpu`` to pass to ``deepspeed.initialize(..., mpu=mpu)``.
* :class:`UlyssesSPDataLoaderAdapter` (``data_adapter.py``) cuts every batch into the ranks' sequence shards.
* ``TiledMLP``, ``SequenceTiledCompute``, ``TiledFusedLogitsLoss`` (``tiled_compute.py``) and the offloaded
  activation checkpoint (``activation_offload.py``) bound the memory of a very long sequence.

Loss convention (see docs/sequence_parallel.md). Every rank of a sequence-parallel group returns the *same* loss:
the token-weighted mean over the whole samples of the group, gathered differentiably from the ranks' shard losses
(:func:`sequence_parallel_loss`, or the Trainer's own aggregation, which computes the same thing). Backward then
makes each rank's gradient ``P`` times its shard's share, and the engine averages dense gradients over all
``dp x sp`` ranks: the optimizer sees the mean over the global batch, exactly as under data parallelism.
"""

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

import deepspeed.comm as dist
from deepspeed.sequence.layer import _SeqAllToAll
from deepspeed.runtime.sequence_parallel.data_adapter import UlyssesSPDataLoaderAdapter
from deepspeed.runtime.sequence_parallel.tiled_compute import (AutogradComputeMLP, SequenceTiledCompute, TiledMLP,
                                                               TiledFusedLogitsLoss, sequence_tiled_compute)
from deepspeed.runtime.sequence_parallel.loss import sequence_parallel_loss

__all__ = [
    "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "sequence_tiled_compute", "SequenceTiledCompute", "TiledMLP",
    "TiledFusedLogitsLoss", "AutogradComputeMLP", "sequence_parallel_loss"
]

# Attention implementations that need a dense [s, s] mask, which a sequence shard cannot provide.
_UNSUPPORTED_CORE = ("eager", "paged|eager")
# core implementation name -> the function registered before ours (so registering again wraps the original).
_ORIGINAL_CORE = {}


class _KVGroupsOverride:
    """The attention module, seen with another ``num_key_value_groups`` (after replicating key/value heads)."""

    def __init__(self, module, num_key_value_groups: int):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "num_key_value_groups", num_key_value_groups)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_module"), name)


class UlyssesSPAttentionHF(torch.nn.Module):
    """Sequence-parallel attention around ``attn``, one of ``transformers``' ``ALL_ATTENTION_FUNCTIONS``.

    Inputs are HF's ``[b, heads, s/P, d]`` query/key/value of this rank's sequence shard (shard ``r`` of the group's
    samples on group rank ``r``); the output is ``[b, s/P, heads, d]`` and the attention weights the core function
    returned. Query heads and key/value heads must divide by ``P``, or ``P`` by the key/value heads (the key/value
    heads are then replicated so each rank holds the one its query heads use): a ``ValueError`` otherwise. The
    core function sees no attention mask (causal masking comes from the global ``position_ids``, so padding is
    expressed through ``-100`` labels, not a mask). With ``disable_in_eval``, a module in eval mode runs ``attn``
    on the local tensors unchanged.
    """

    def __init__(
        self,
        attn,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group,
        seq_length_is_variable: bool = False,
        local_seq_length: Optional[int] = None,
        global_seq_length: Optional[int] = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size = batch_size
        self.attn_head_count = attn_head_count
        self.attn_head_size = attn_head_size
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.disable_in_eval = disable_in_eval
        self.core_attn_implementation = None
        check_head_counts(attn_head_count, kv_head_count, self.world_size)
        self.local_q_head_count = attn_head_count // self.world_size
        self.kv_replication_factor = max(1, self.world_size // kv_head_count)
        self.local_kv_head_count = max(1, kv_head_count // self.world_size)
        if not seq_length_is_variable:
            if local_seq_length is None or global_seq_length is None:
                raise ValueError("UlyssesSPAttentionHF: a fixed sequence length needs local_seq_length and "
                                 "global_seq_length (or seq_length_is_variable=True)")
            if local_seq_length * self.world_size != global_seq_length:
                raise ValueError(f"UlyssesSPAttentionHF: global_seq_length ({global_seq_length}) must be "
                                 f"local_seq_length ({local_seq_length}) x the group size ({self.world_size})")

    def _exchange(self, t: Tensor) -> Tensor:
        # Dimension 1 is scattered and dimension 2 gathered both ways: [b, h, s/P, d] -> [b, h/P, s, d] before
        # attention, and the context [b, s, h/P, d] -> [b, s/P, h, d] after it.
        return _SeqAllToAll.apply(self.process_group, t.contiguous(), 1, 2, 0)

    def _check_shapes(self, query: Tensor, key: Tensor) -> None:
        b, hq, s_local, d = query.shape
        if hq != self.attn_head_count or key.shape[1] != self.global_kv_head_count or d != self.attn_head_size:
            raise ValueError(f"UlyssesSPAttentionHF: query {tuple(query.shape)} / key {tuple(key.shape)} do not "
                             f"match the registered heads (query {self.attn_head_count}, key/value "
                             f"{self.global_kv_head_count}, head size {self.attn_head_size})")
        if not self.seq_length_is_variable and (s_local != self.local_seq_length or b != self.batch_size):
            raise ValueError(f"UlyssesSPAttentionHF: registered for a fixed [batch, local sequence] of "
                             f"[{self.batch_size}, {self.local_seq_length}], got [{b}, {s_local}]; register with "
                             f"seq_length_is_variable=True for varying lengths")

    def forward(self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor,
                *args: Any, **kwargs: Any) -> Tuple[Tensor, Any]:
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check_shapes(query, key)
        if self.kv_replication_factor > 1:
            key = key.repeat_interleave(self.kv_replication_factor, dim=1)
            value = value.repeat_interleave(self.kv_replication_factor, dim=1)
        q = self._exchange(query)
        k = self._exchange(key)
        v = self._exchange(value)
        position_ids = kwargs.get("position_ids")
        if torch.is_tensor(position_ids) and self.world_size > 1:
            kwargs["position_ids"] = _gather_sequence(position_ids, self.process_group)
        core_module = module
        local_groups = q.shape[1] // k.shape[1]
        if getattr(module, "num_key_value_groups", local_groups) != local_groups:
            core_module = _KVGroupsOverride(module, local_groups)
        context, weights = self.attn(core_module, q, k, v, None, *args, **kwargs)
        # The core function returns [b, s, h/P, d]; send the sequence back to its shards.
        output = self._exchange(context)
        return output, weights

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path,
        core_attn_implementation,
        sequence_parallel_size,
        micro_batch_size,
        seq_length=None,
        seq_length_is_variable=True,
        disable_in_eval=False,
        max_length=None,
    ):
        """Install Ulysses attention under ``core_attn_implementation`` in Transformers and return the ``mpu``.

        ``model_name_or_path``: a loaded model (a ``PreTrainedModel`` or a wrapper such as a PEFT model: anything
        with the model's ``config``), a hub name or a local path (its config is read). With
        ``sequence_parallel_size == 1`` nothing is installed and None is returned. ``seq_length`` fixes the global
        sequence length (``seq_length_is_variable=False``); ``max_length`` is its old name. Every argument is
        checked (heads against the group size, the attention implementation, the lengths) before any process group
        is created, so a bad value raises the same ``ValueError`` on every rank and nothing hangs.

        Returns ``deepspeed.runtime.sequence_parallel.parallel_state_sp`` (the sequence-parallel and
        sequence-data-parallel groups), for ``deepspeed.initialize(..., mpu=mpu)``.
        """
        if sequence_parallel_size == 1:
            return None
        if seq_length is None and max_length is not None:
            seq_length = max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("register_with_transformers: set seq_length for a fixed sequence length, or "
                             "seq_length_is_variable=True")
        if not seq_length_is_variable and seq_length % sequence_parallel_size != 0:
            raise ValueError(f"register_with_transformers: seq_length ({seq_length}) must be divisible by "
                             f"sequence_parallel_size ({sequence_parallel_size})")
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        config, loaded = _model_config(model_name_or_path)
        if loaded:
            active = getattr(config, "_attn_implementation", None)
            if active is not None and active != core_attn_implementation:
                raise ValueError(f"core_attn_implementation={core_attn_implementation!r} differs from the model's "
                                 f"attn_implementation {active!r}: load the model with the same one")
        if core_attn_implementation in _UNSUPPORTED_CORE:
            raise ValueError(f"attn_implementation {core_attn_implementation!r} needs a dense attention mask, which "
                             f"Ulysses sequence parallelism cannot provide; use 'sdpa' or a flash attention")
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS and core_attn_implementation not in _ORIGINAL_CORE:
            raise ValueError(f"{core_attn_implementation!r} is not a valid attn_implementation: choose one of "
                             f"{ALL_ATTENTION_FUNCTIONS.valid_keys()}")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_size = getattr(text, "head_dim", None) or text.hidden_size // heads
        check_head_counts(heads, kv_heads, sequence_parallel_size)

        from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
        mpu.initialize_sequence_parallel(sequence_parallel_size=sequence_parallel_size)

        core = _ORIGINAL_CORE.get(core_attn_implementation, ALL_ATTENTION_FUNCTIONS[core_attn_implementation])
        fixed = not seq_length_is_variable
        uattn = cls(attn=core,
                    batch_size=micro_batch_size,
                    attn_head_count=heads,
                    attn_head_size=head_size,
                    kv_head_count=kv_heads,
                    num_hidden_layers=text.num_hidden_layers,
                    process_group=mpu.get_sequence_parallel_group(),
                    seq_length_is_variable=seq_length_is_variable,
                    local_seq_length=seq_length // sequence_parallel_size if fixed else None,
                    global_seq_length=seq_length if fixed else None,
                    disable_in_eval=disable_in_eval)
        uattn.core_attn_implementation = core_attn_implementation

        def ulysses_attention(module, query, key, value, attention_mask, *args, **kwargs):
            # The mask Transformers built covers the local shard only; causality comes from is_causal and the
            # global position_ids, so it is dropped (a dense [s, s] mask would also defeat long sequences).
            return uattn(module, query, key, value, None, *args, **kwargs)

        ulysses_attention.ulysses = uattn
        _ORIGINAL_CORE.setdefault(core_attn_implementation, core)
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = ulysses_attention
        return mpu

    @classmethod
    def unregister_from_transformers(cls, core_attn_implementation) -> None:
        """Put back the core attention function that ``register_with_transformers`` replaced (no-op if none)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        original = _ORIGINAL_CORE.pop(core_attn_implementation, None)
        if original is not None:
            ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = original


def check_head_counts(heads: int, kv_heads: int, sp_size: int) -> None:
    """Raise ``ValueError`` unless ``sp_size`` divides the query heads, and divides or is divided by the kv heads."""
    if heads % sp_size != 0:
        raise ValueError(f"sequence parallelism: the attention head count ({heads}) must be divisible by "
                         f"sequence_parallel_size ({sp_size})")
    if kv_heads % sp_size != 0 and sp_size % kv_heads != 0:
        raise ValueError(f"sequence parallelism: the key/value head count ({kv_heads}) and sequence_parallel_size "
                         f"({sp_size}) must divide one another")


def _gather_sequence(t: Tensor, group) -> Tensor:
    """The group's ``[..., s/P]`` pieces of ``t`` concatenated in rank order along the last dimension."""
    with torch.no_grad():
        pieces = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, t.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def _model_config(model_name_or_path) -> Tuple[Any, bool]:
    """``(the model's config, whether a model object was given)``; PEFT wrappers expose their base model's."""
    if isinstance(model_name_or_path, (str, bytes)) or hasattr(model_name_or_path, "__fspath__"):
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(model_name_or_path), False
    model = model_name_or_path
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_attention_heads") and not hasattr(config, "get_text_config"):
        raise ValueError(f"register_with_transformers: {type(model_name_or_path).__name__} has no Transformers "
                         f"config; pass an HF model, a hub name or a local path")
    return config, True
