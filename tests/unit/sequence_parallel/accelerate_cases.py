# SPDX-License-Identifier: Apache-2.0
"""HF Accelerate's ``ParallelismConfig(sp_backend="deepspeed", sp_size=2)`` driving a tiny Llama, run unchanged:
``prepare`` registers Ulysses attention, builds the engine with the returned mpu and wraps the data loader; one
``accelerator.backward`` (which steps) must move every parameter by ``-lr`` times the unsharded model's gradient.

The reference is rebuilt from the shards the ranks were handed (gathered, concatenated per group): plain torch on
whole samples, the mean over the data-parallel replicas of each sample's token-mean loss.
"""

import copy

import torch
import torch.nn.functional as F

from tests.unit.sequence_parallel.llama_cases import VOCAB, sample, tiny_llama

LR = 1.0


def _whole_samples(shard, sp):
    """Every group's whole sample, rebuilt from all ranks' shards (group g: ranks [g*sp, (g+1)*sp))."""
    world = torch.distributed.get_world_size()
    shards = [None] * world
    torch.distributed.all_gather_object(shards, {k: v for k, v in shard.items() if torch.is_tensor(v)})
    samples = []
    for start in range(0, world, sp):
        pieces = shards[start:start + sp]
        samples.append({k: torch.cat([p[k] for p in pieces], dim=1) for k in pieces[0]})
    return samples


def _reference_grads(model, samples):
    losses = []
    for s in samples:
        logits = model(input_ids=s["input_ids"], position_ids=s["position_ids"]).logits
        losses.append(F.cross_entropy(logits.float().view(-1, VOCAB), s["shift_labels"].view(-1), ignore_index=-100))
    torch.stack(losses).mean().backward()
    return [loss.detach() for loss in losses], {
        n: p.grad.clone()
        for n, p in model.named_parameters() if p.grad is not None
    }


def run_accelerate_case(stage, sp=2, seq=8):
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, DeepSpeedSequenceParallelConfig

    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, sequence_parallel_loss
    from deepspeed.utils import groups, safe_get_full_fp32_param
    world = torch.distributed.get_world_size()
    model = tiny_llama()
    ref_model = copy.deepcopy(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = [{k: v[0] for k, v in sample(i, seq).items()} for i in range(world)]
    loader = torch.utils.data.DataLoader(data, batch_size=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": stage
        },
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
    }
    parallelism = ParallelismConfig(dp_replicate_size=world // sp,
                                    sp_backend="deepspeed",
                                    sp_size=sp,
                                    sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=seq,
                                                                               sp_seq_length_is_variable=False,
                                                                               sp_attn_implementation="sdpa"))
    try:
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config),
                                  parallelism_config=parallelism)
        engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        assert engine.dp_world_size == world // sp
        shard = next(iter(loader))
        group = groups._get_sequence_parallel_group()
        out = engine(input_ids=shard["input_ids"],
                     position_ids=shard["position_ids"],
                     labels=shard["shift_labels"],
                     shift_labels=shard["shift_labels"])
        loss = sequence_parallel_loss(out.loss, (shard["shift_labels"] != -100).sum(), group)
        accelerator.backward(loss)
        moved = {n: (safe_get_full_fp32_param(p) - start[n]) / -LR for n, p in engine.module.named_parameters()}
    finally:
        UlyssesSPAttentionHF.unregister_from_transformers("sdpa")
        AcceleratorState._reset_state(True)
    ref_losses, ref_grads = _reference_grads(ref_model, _whole_samples(shard, sp))
    torch.testing.assert_close(loss.detach(), ref_losses[torch.distributed.get_rank() // sp])
    assert moved.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(moved[name], grad, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    engine.destroy()
