# SPDX-License-Identifier: Apache-2.0
"""register_with_transformers: clear errors on every rank before any group is created, the mpu it returns, and
the attention function it installs and removes."""

import pytest
import torch

from tests.unit.common import run_distributed

pytest.importorskip("transformers")


def _errors():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from tests.unit.sequence_parallel.llama_cases import tiny_llama
    register = UlyssesSPAttentionHF.register_with_transformers
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with pytest.raises(ValueError, match=r"attention head count \(3\) must be divisible"):
        register(tiny_llama(heads=3, kv_heads=3, hidden=18), "sdpa", 2, 1, seq_length_is_variable=True)
    with pytest.raises(ValueError, match=r"key/value head count \(3\)"):
        register(tiny_llama(heads=12, kv_heads=3, hidden=24), "sdpa", 4, 1, seq_length_is_variable=True)
    with pytest.raises(ValueError, match="differs from the model"):
        register(tiny_llama(), "flash_attention_2", 2, 1, seq_length_is_variable=True)
    with pytest.raises(ValueError, match="seq_length"):
        register(tiny_llama(), "sdpa", 2, 1, seq_length=None, seq_length_is_variable=False)
    with pytest.raises(ValueError, match="divisible by sequence_parallel_size"):
        register(tiny_llama(), "sdpa", 2, 1, seq_length=7, seq_length_is_variable=False)
    assert register(tiny_llama(), "sdpa", 1, 1) is None
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before  # nothing installed by a failed or trivial registration


def test_registration_errors_are_clear_on_every_rank():
    run_distributed(_errors, 2)


def _registers_and_restores():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from deepspeed.utils import groups
    from tests.unit.sequence_parallel.llama_cases import tiny_llama
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        for _ in range(2):  # registering twice wraps the original, not the previous wrapper
            mpu = UlyssesSPAttentionHF.register_with_transformers(tiny_llama(kv_heads=1), "sdpa", 2, 1)
            assert ALL_ATTENTION_FUNCTIONS["sdpa"].ulysses.attn is original
        assert mpu.get_sequence_parallel_world_size() == 2 == groups._get_sequence_parallel_world_size()
        assert mpu.get_sequence_parallel_rank() == torch.distributed.get_rank() % 2
        assert mpu.get_sequence_data_parallel_world_size() == torch.distributed.get_world_size()
        uattn = ALL_ATTENTION_FUNCTIONS["sdpa"].ulysses
        assert uattn.kv_replication_factor == 2 and uattn.local_kv_head_count == 1
    finally:
        UlyssesSPAttentionHF.unregister_from_transformers("sdpa")
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original


def test_register_installs_once_and_restores():
    run_distributed(_registers_and_restores, 2)


def _gqa_replicated_kv_matches():
    # One key/value head, sp 2: each rank gets a copy of it; the forward equals the unsharded model's.
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from tests.unit.sequence_parallel.llama_cases import sample, tiny_llama
    model = tiny_llama(kv_heads=1)
    batch = sample(0, 8)
    with torch.no_grad():
        ref = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    rank = dist.get_rank()
    try:
        UlyssesSPAttentionHF.register_with_transformers(model,
                                                        "sdpa",
                                                        2,
                                                        1,
                                                        seq_length=8,
                                                        seq_length_is_variable=False)
        with torch.no_grad():
            out = model(input_ids=batch["input_ids"][:, 4 * rank:4 * rank + 4],
                        position_ids=batch["position_ids"][:, 4 * rank:4 * rank + 4]).logits
    finally:
        UlyssesSPAttentionHF.unregister_from_transformers("sdpa")
    torch.testing.assert_close(out, ref[:, 4 * rank:4 * rank + 4], atol=1e-5, rtol=1e-5)


def test_replicated_kv_heads_match_unsharded():
    run_distributed(_gqa_replicated_kv_matches, 2)
