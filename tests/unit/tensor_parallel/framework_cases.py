# SPDX-License-Identifier: Apache-2.0
"""The Transformers Trainer and HF Accelerate with ``tensor_parallel.autotp_size`` in the DeepSpeed config, run
unchanged on a tiny Qwen3 (whose q_norm/k_norm act on the cut heads).

Trainer: a run stops after the first SGD step's checkpoint and a new Trainer resumes from it
(``train(resume_from_checkpoint=...)``) for the second step; it ends where plain torch ends after two steps:
every sample of the data set is the same one, so the reference does not depend on how the Trainer orders and
distributes samples. The saved model (``save_model``, through Accelerate's ``get_state_dict`` and the engine's
``_consolidated_16bit_state_dict``) is the unsharded Hugging Face state dict.

Accelerate: ``prepare(model, optimizer, loader)``; each data-parallel rank gets its own samples (Accelerate shards
by ``process_index // tp``) and the tensor-parallel ranks of a group the same ones; one step; the unsharded state
(``accelerator.get_state_dict``) equals the plain-torch step on every data-parallel rank's sample.
"""

import contextlib
import copy
import os

import torch

from tests.unit.tensor_parallel import reference as ref

LR = 0.5


@contextlib.contextmanager
def _accelerate_backend():
    """Accelerate picks its distributed backend from the accelerator it finds: on a machine without GPU it would run
    as one process. Here it takes the live gloo group, as it takes NCCL's on a GPU machine (DeepSpeed type, every rank
    a process)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType
    original = PartialState._prepare_backend

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        return "gloo", DistributedType.MULTI_CPU

    PartialState._prepare_backend = prepare_backend
    AcceleratorState._reset_state(True)
    try:
        yield
    finally:
        PartialState._prepare_backend = original
        AcceleratorState._reset_state(True)


class _Samples(torch.utils.data.Dataset):

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {k: v.clone() for k, v in self.items[i].items()}


def _item(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ref.VOCAB, (ref.SEQ, ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _sgd_reference(model, batches_per_step):
    """Plain torch: each step's gradient is the mean of the losses of its samples (whole batches)."""
    model = copy.deepcopy(model).double()
    for samples in batches_per_step:
        model.zero_grad()
        loss = sum(model(input_ids=s["input_ids"][None], labels=s["labels"][None]).loss for s in samples)
        (loss / len(samples)).backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(LR * p.grad)
    return {k: v.float() for k, v in model.state_dict().items()}


def _compare(got, want, what):
    bad = []
    for name, w in want.items():
        g = got.get(name)
        if g is None or tuple(g.shape) != tuple(w.shape):
            bad.append(f"{what}: {name} missing or of shape {None if g is None else tuple(g.shape)}")
        elif not torch.allclose(g.float(), w, atol=2e-5, rtol=1e-4):
            bad.append(f"{what}: {name} max |diff| {float((g.float() - w).abs().max()):.3g}")
    return bad


def _trainer(model, out_dir, max_steps, stage, tp, items, save=False):
    from transformers import Trainer, TrainingArguments
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": stage,
            "stage3_gather_16bit_weights_on_model_save": True
        },
        "tensor_parallel": {
            "autotp_size": tp
        },
        "zero_allow_untested_optimizer": True,
    }
    args = TrainingArguments(output_dir=out_dir,
                             per_device_train_batch_size=1,
                             max_steps=max_steps,
                             learning_rate=LR,
                             lr_scheduler_type="constant",
                             optim="sgd",
                             weight_decay=0.0,
                             max_grad_norm=0.0,
                             deepspeed=ds_config,
                             report_to=[],
                             save_strategy="steps" if save else "no",
                             save_steps=1,
                             logging_strategy="no",
                             dataloader_num_workers=0,
                             seed=0,
                             data_seed=0)
    return Trainer(model=model, args=args, train_dataset=_Samples(items))


def run_trainer_case(stage, tp, tmp_dir):
    from accelerate.state import AcceleratorState
    from deepspeed.runtime.tensor_parallel import init_utils
    world = torch.distributed.get_world_size()
    item = _item(3)
    items = [item] * (4 * world)
    model = ref.build("qwen3", seed=5)
    want = _sgd_reference(model, [[item], [item]])
    out = os.path.join(str(tmp_dir), "resume")
    bad = []
    with _accelerate_backend():
        # stop after the first step's checkpoint, resume in a new Trainer
        first = _trainer(copy.deepcopy(model), out, 1, stage, tp, items, save=True)
        first.train()
        first.model_wrapped.destroy()
        AcceleratorState._reset_state(True)
        init_utils.reset()
        second = _trainer(copy.deepcopy(model), out, 2, stage, tp, items, save=True)
        second.train(resume_from_checkpoint=os.path.join(out, "checkpoint-1"))
        state = second.model_wrapped._consolidated_16bit_state_dict()
        if torch.distributed.get_rank() == 0:
            bad += _compare(state, want, "resumed")
        second.save_model(os.path.join(out, "final"))
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            from safetensors.torch import load_file
            saved = load_file(os.path.join(out, "final", "model.safetensors"))
            bad += _compare(saved, {k: v for k, v in want.items() if k in saved}, "save_model")
            missing = sorted(set(want) - set(saved) - {"lm_head.weight"})
            if missing:
                bad.append(f"save_model: missing {missing[:3]}")
        second.model_wrapped.destroy()
    init_utils.reset()
    return bad


def run_accelerate_case(stage, tp):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.tensor_parallel import init_utils
    from deepspeed.utils import groups
    world = torch.distributed.get_world_size()
    dp = world // tp
    items = [_item(10 + i) for i in range(dp)]
    model = ref.build("qwen3", seed=6)
    want = _sgd_reference(model, [items])
    loader = torch.utils.data.DataLoader(_Samples(items), batch_size=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": stage,
            "stage3_gather_16bit_weights_on_model_save": True
        },
        "tensor_parallel": {
            "autotp_size": tp
        },
        "zero_allow_untested_optimizer": True,
    }
    bad = []
    with _accelerate_backend():
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config))
        engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        if groups.get_tensor_model_parallel_world_size() != tp or engine.dp_world_size != dp:
            bad.append(f"groups: tp {groups.get_tensor_model_parallel_world_size()}, dp {engine.dp_world_size}")
        batch = next(iter(loader))
        loss = engine(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        state = accelerator.get_state_dict(engine)
        if torch.distributed.get_rank() == 0:
            bad += _compare(state, want, "get_state_dict")
        engine.destroy()
    init_utils.reset()
    return bad
