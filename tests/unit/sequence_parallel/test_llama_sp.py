# SPDX-License-Identifier: Apache-2.0
"""Ulysses sequence parallelism end to end: a tiny LlamaForCausalLM (sdpa) at world 2 (sp 2) and world 4
(sp 2 x dp 2), ZeRO stages 0-3, fp32 and bf16, plain and PEFT LoRA: the loss and every optimizer-visible gradient
equal the unsharded model's on the same samples (tests/unit/sequence_parallel/llama_cases.py)."""

import pytest

from tests.unit.common import run_distributed

pytest.importorskip("transformers")

# A covering subset: every stage at both worlds, both dtypes, each stage once with bf16.
CELLS = [(2, 0, False), (2, 1, True), (2, 2, False), (2, 3, True), (4, 0, True), (4, 1, False), (4, 2, True),
         (4, 3, False)]


def _case(stage, bf16, sp, **options):
    from tests.unit.sequence_parallel.llama_cases import run_case
    return run_case(stage, bf16, sp, **options)


@pytest.mark.parametrize("world,stage,bf16", CELLS)
def test_llama_sp_matches_unsharded(world, stage, bf16):
    run_distributed(_case, world, args=(stage, bf16, 2), timeout=240)


@pytest.mark.parametrize("world,stage", [(2, 1), (4, 2), (4, 3)])
def test_llama_sp_gradient_accumulation_matches_unsharded(world, stage):
    # GAS 2 takes both micro-batches of a refill: every sample of every group, each rank's shard of it.
    run_distributed(_case, world, args=(stage, False, 2), kwargs={"gas": 2}, timeout=240)


@pytest.mark.parametrize("world,stage", [(2, 2), (4, 3)])
def test_llama_sp_variable_lengths_match_unsharded(world, stage):
    # Samples of 7, 8, 9, 10 tokens (by rank), padded to the group size; both micro-batches of a refill.
    run_distributed(_case, world, args=(stage, False, 2), kwargs={"seq": 7, "variable": True, "gas": 2}, timeout=240)


@pytest.mark.parametrize("world,stage", [(2, 3), (4, 2)])
def test_llama_sp_lora_matches_unsharded(world, stage):
    pytest.importorskip("peft")
    run_distributed(_case, world, args=(stage, False, 2), kwargs={"lora": True}, timeout=240)


@pytest.mark.parametrize("world,stage,lora", [(2, 3, False), (4, 2, True), (2, 0, True)])
def test_llama_sp_with_offloaded_checkpoints_matches_unsharded(world, stage, lora):
    # Every layer recomputed from its input on the host, inside the backward; under LoRA no input needs a grad.
    run_distributed(_case,
                    world,
                    args=(stage, False, 2),
                    kwargs={
                        "checkpoint_offload": True,
                        "lora": lora
                    },
                    timeout=240)


@pytest.mark.parametrize("world,stage,offload", [(2, 3, True), (4, 2, False)])
def test_llama_sp_with_norms_recomputed_matches_unsharded(world, stage, offload):
    # RMSNorms rerun in backward (inside the offloaded layer checkpoints or not); stage 3 releases their weights
    run_distributed(_case,
                    world,
                    args=(stage, False, 2),
                    kwargs={
                        "recompute_norms": True,
                        "checkpoint_offload": offload,
                        "tiled_mlp": True
                    },
                    timeout=240)


@pytest.mark.parametrize("world,stage,bf16,lora,offload", [(2, 0, False, False, False), (2, 3, True, False, True),
                                                           (4, 2, False, True, True), (4, 3, False, False, False)])
def test_llama_sp_with_tiled_decoder_layers_matches_unsharded(world, stage, bf16, lora, offload):
    # the token-wise parts of every layer in tiles around the Ulysses attention, alone or inside offloaded
    # checkpoints; under LoRA only the adapters (inside the tiled projections) train
    if lora:
        pytest.importorskip("peft")
    run_distributed(_case,
                    world,
                    args=(stage, bf16, 2),
                    kwargs={
                        "tiled_layers": True,
                        "lora": lora,
                        "checkpoint_offload": offload
                    },
                    timeout=240)


def test_llama_sp_with_tiled_decoder_layers_and_variable_lengths_matches_unsharded():
    # padded samples of 7 and 8 tokens; tiles of 3 tokens over shards of 4
    run_distributed(_case,
                    2,
                    args=(3, False, 2),
                    kwargs={
                        "tiled_layers": True,
                        "seq": 7,
                        "variable": True,
                        "gas": 2
                    },
                    timeout=240)


@pytest.mark.parametrize("world,stage", [(2, 0), (2, 3), (4, 3)])
def test_llama_sp_with_tiled_mlp_and_logits_loss_matches_unsharded(world, stage):
    run_distributed(_case, world, args=(stage, False, 2), kwargs={"tiled_mlp": True, "tiled_loss": True}, timeout=240)


def _accelerate_case(stage):
    from tests.unit.sequence_parallel.accelerate_cases import run_accelerate_case
    run_accelerate_case(stage)


@pytest.mark.parametrize("world,stage", [(2, 1), (4, 3)])
def test_accelerate_parallelism_config_runs_unchanged(world, stage):
    pytest.importorskip("accelerate")
    run_distributed(_accelerate_case, world, args=(stage, ), timeout=240)


def _trainer_case(stage, tmp_dir):
    from tests.unit.sequence_parallel.trainer_cases import run_trainer_case
    run_trainer_case(stage, tmp_dir)


def test_trainer_with_sp_size_runs_unchanged(tmp_path):
    pytest.importorskip("accelerate")
    run_distributed(_trainer_case, 2, args=(2, str(tmp_path)), timeout=300)
