# SPDX-License-Identifier: Apache-2.0
"""The Transformers Trainer with ``parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2)`` and a
DeepSpeed config, run unchanged on a tiny Llama: one SGD step (lr 1) must move every parameter by minus the
unsharded model's gradient. Every sample of the data set is the same one, so the reference does not depend on how
the Trainer orders and distributes samples; its two shards hold different numbers of valid tokens, so the Trainer's
token-weighted aggregation across the group is what is checked."""

import copy

import torch

from tests.unit.sequence_parallel.llama_cases import sample, sample_loss, tiny_llama


class _Samples(torch.utils.data.Dataset):

    def __init__(self, item, n):
        self.item, self.n = item, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {k: v.clone() for k, v in self.item.items()}


def run_trainer_case(stage, tmp_dir, sp=2, seq=8):
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from transformers import Trainer, TrainingArguments

    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from deepspeed.utils import safe_get_full_fp32_param
    world = torch.distributed.get_world_size()
    model = tiny_llama()
    ref = copy.deepcopy(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    item = {k: v[0] for k, v in sample(0, seq).items()}
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": stage
        },
        "zero_allow_untested_optimizer": True,
    }
    parallelism = ParallelismConfig(dp_replicate_size=world // sp,
                                    sp_backend="deepspeed",
                                    sp_size=sp,
                                    sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=seq,
                                                                               sp_seq_length_is_variable=False,
                                                                               sp_attn_implementation="sdpa"))
    args = TrainingArguments(output_dir=str(tmp_dir),
                             per_device_train_batch_size=1,
                             max_steps=1,
                             learning_rate=1.0,
                             lr_scheduler_type="constant",
                             optim="sgd",
                             weight_decay=0.0,
                             max_grad_norm=0.0,
                             deepspeed=ds_config,
                             parallelism_config=parallelism,
                             report_to=[],
                             save_strategy="no",
                             logging_strategy="no",
                             dataloader_num_workers=0,
                             seed=0,
                             data_seed=0)
    try:
        trainer = Trainer(model=model, args=args, train_dataset=_Samples(item, 4 * world))
        trainer.train()
        engine = trainer.model_wrapped
        moved = {n: (start[n] - safe_get_full_fp32_param(p)) for n, p in engine.module.named_parameters()}
    finally:
        UlyssesSPAttentionHF.unregister_from_transformers("sdpa")
        AcceleratorState._reset_state(True)
    batch = {k: v.unsqueeze(0) for k, v in item.items()}
    sample_loss(ref, batch).backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(moved[name], p.grad, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    engine.destroy()
