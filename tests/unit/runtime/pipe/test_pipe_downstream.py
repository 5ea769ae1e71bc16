# SPDX-License-Identifier: Apache-2.0
"""What diffusion-pipe, qlora-pipe and GPT-NeoX do with the pipeline engine, done here, checked against plain torch.

* diffusion-pipe: a ``PipelineModule`` subclass that sets an attribute before ``super().__init__`` and overrides
  ``_partition_layers`` (reading ``_layer_specs``, ``_topo``, ``global_rank``; setting ``parts``, calling
  ``_set_bounds``); ``_count_layer_params`` and ``TrainSchedule.steps`` patched (loads first in each step); an
  instruction of ``_INSTRUCTION_MAP`` replaced; a frozen stage whose optimizer callable returns an optimizer without
  parameters; ``first_last_stage_group`` made from ``grid.pp_group``; ``lr_scheduler`` reassigned;
  ``communication_data_type`` set; ``reset_activation_shape()`` every batch with lengths changing between batches;
  ``save_checkpoint(exclude_frozen_parameters=True)`` / ``load_checkpoint(load_module_strict=False)``;
  ``eval_batch(num_micro_batches=...)``.
* qlora-pipe: a column-major ``ProcessTopology`` (axes ``['data', 'pipe']``) at pipe 2 x data 2; a ``LayerSpec``
  subclass with its own ``build``; a ``PipelineEngine`` subclass built directly (``mpu=model.mpu()``,
  ``config_class``), overriding ``train_batch`` (its own ``_exec_schedule`` call and loss aggregation over
  ``fwd_outputs``) and ``_exec_forward_pass`` (``super(PipelineEngine, self).forward``, ``pipe_buffers``,
  ``tput_timer``, ``mem_status``), with an instruction of its own in ``_INSTRUCTION_MAP``; ``p2p.send``/``recv``
  from the last stage to the first.
* GPT-NeoX: ``PipeModelDataParallelTopology``, a module class named ``GPT2ModelPipe`` whose activation tuple ends
  in a bool attention mask, ``set_has_attention_mask``, ``set_batch_fn``, ``micro_batches`` reassigned and
  ``eval_batch(return_logits=True)``, ``first_output_send``/``pipe_recv_buf`` reset by hand, ``grid.stage_to_global``.
"""

import copy

import torch

from tests.unit.common import run_distributed

D = 4


def _sgd(lr=0.1):
    return {"type": "SGD", "params": {"lr": lr}}


def _batches(step, count, t=3, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + step)
    return [(torch.randn(2, t, D, generator=g), torch.randn(2, t, D, generator=g)) for _ in range(count)]


def _reference_step(model, batches, lr=0.1, scale=1.0):
    """One SGD step of plain torch over ``batches`` (the mean loss); returns it."""
    params = [p for p in model.parameters() if p.requires_grad]
    loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in batches) / len(batches)
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p -= lr * scale * g
    return float(loss)


def _compare(engine, reference):
    """Largest difference between the engine's stage parameters and the reference's (by global layer index)."""
    worst = 0.0
    ref = dict(reference.named_parameters())
    for name, p in engine.module.named_parameters():
        worst = max(worst, float((p.detach() - ref[name]).abs().max()))
    return worst


# ------------------------------------------------------------------------------------------------ diffusion-pipe
def _diffusion_pipe(tmp):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.pipe import module as ds_pipe_module
    from deepspeed.runtime.pipe import schedule as S
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.pipe import PipelineModule

    class ManualPipelineModule(PipelineModule):

        def __init__(self, *args, manual_partition_split=None, **kwargs):
            self.manual_partition_split = manual_partition_split
            super().__init__(*args, **kwargs)

        def _partition_layers(self, method="uniform"):
            if method.lower() == "manual" and self.manual_partition_split is not None:
                self.parts = [0] + self.manual_partition_split + [len(self._layer_specs)]
                stage_id = self._topo.get_coord(self.global_rank).pipe
                self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])
            else:
                super()._partition_layers(method)

    def count_all(self):  # counts frozen parameters too
        built = [s.build() if isinstance(s, ds_pipe_module.LayerSpec) else s for s in self._layer_specs]
        return [sum(p.numel() for p in m.parameters()) if isinstance(m, torch.nn.Module) else 0 for m in built]

    def loads_first(self):  # diffusion-pipe's TrainSchedule.steps: LoadMicroBatch before the transfers
        for cmds in original_steps(self):
            loads = [c for c in cmds if isinstance(c, S.LoadMicroBatch)]
            yield loads + [c for c in cmds if not isinstance(c, S.LoadMicroBatch)]

    reduce_calls = []

    def reduce_grads(self):
        reduce_calls.append(self.global_steps)
        return original_reduce(self)

    class DummyOptimizer(torch.optim.Optimizer):

        def __init__(self):
            self.state, self.param_groups = {}, []

        def step(self, closure=None):
            pass

        def zero_grad(self, set_to_none=True):
            pass

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    original_count, original_steps = ds_pipe_module.PipelineModule._count_layer_params, S.TrainSchedule.steps
    original_reduce = PipelineEngine._INSTRUCTION_MAP[S.ReduceGrads]
    ds_pipe_module.PipelineModule._count_layer_params = count_all
    S.TrainSchedule.steps = loads_first
    PipelineEngine._INSTRUCTION_MAP[S.ReduceGrads] = reduce_grads
    try:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(D, D), torch.nn.Tanh(), torch.nn.Linear(D, D), torch.nn.Linear(D, D)]
        layers[0].requires_grad_(False)  # the frozen base of a LoRA-style run: stage 0 trains nothing
        reference = torch.nn.Sequential(*copy.deepcopy(layers))
        model = ManualPipelineModule(layers,
                                     num_stages=2,
                                     partition_method="manual",
                                     manual_partition_split=[2],
                                     loss_fn=torch.nn.functional.mse_loss)
        assert model.parts == [0, 2, 4] and model._count_layer_params() == [20, 0, 20, 20]

        def get_optimizer(params):
            params = list(params)
            return DummyOptimizer() if not params else torch.optim.SGD(params, lr=0.1)

        trainable = [p for p in model.parameters() if p.requires_grad]
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.0,
            "steps_per_print": 1
        }
        engine, optimizer, _, _ = deepspeed.initialize(model=model,
                                                       model_parameters=trainable,
                                                       optimizer=get_optimizer,
                                                       config=cfg)
        engine._support_torch_style_backward = True
        if engine.is_pipe_parallel:
            grid = engine.grid
            engine.first_last_stage_group = dist.new_group(ranks=[grid.pp_group[0], grid.pp_group[-1]])
        # diffusion-pipe builds ConstantLR(optimizer) on what initialize returns: upstream's bare torch optimizer on
        # ZeRO-0 fp32; here that is a wrapper torch's schedulers refuse, so the scheduler takes the torch optimizer
        # inside it (the same param-group dicts; docs/compatibility.md)
        engine.lr_scheduler = torch.optim.lr_scheduler.ConstantLR(optimizer.optimizer, factor=1.0)
        engine.communication_data_type = torch.float32
        engine.total_steps = 3
        worst = 0.0
        for step, t in enumerate([3, 5, 2]):  # another length every batch, the same within one
            engine.reset_activation_shape()
            batches = _batches(step, 2, t)
            it = iter(batches) if (engine.is_first_stage() or engine.is_last_stage()) else None
            loss = engine.train_batch(it).item()
            expected = _reference_step(reference, batches)
            worst = max(worst, abs(loss - expected), _compare(engine, reference))
        engine.save_checkpoint(tmp,
                               client_state={
                                   "step": 3,
                                   "custom_loader": {
                                       "epoch": 1
                                   }
                               },
                               exclude_frozen_parameters=True)
        saved = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        with torch.no_grad():
            for p in engine.module.parameters():
                p.add_(1.0)
        path, client = engine.load_checkpoint(tmp, load_module_strict=False)
        frozen_moved = max(
            float((p - saved[n] - 1.0).abs().max()) for n, p in engine.module.named_parameters()
            if not p.requires_grad) if engine.is_first_stage() else 0.0
        restored = max(
            float((p - saved[n]).abs().max()) for n, p in engine.module.named_parameters()
            if p.requires_grad) if not engine.is_first_stage() else 0.0
        engine.reset_activation_shape()
        evals = _batches(9, 3)
        ev = engine.eval_batch(iter(evals), num_micro_batches=3).item()
        with torch.no_grad():
            # the frozen layer moved by +1 and, excluded from the checkpoint, stayed so: the reference follows
            reference[0].weight.add_(1.0)
            reference[0].bias.add_(1.0)
            expected_eval = sum(float(torch.nn.functional.mse_loss(reference(x), y)) for x, y in evals) / 3
        result = dict(worst=worst,
                      reduce_calls=len(reduce_calls),
                      client=client["step"],
                      restored=restored,
                      frozen_moved=frozen_moved,
                      eval=abs(ev - expected_eval))
        engine.destroy()
        return result
    finally:
        ds_pipe_module.PipelineModule._count_layer_params = original_count
        S.TrainSchedule.steps = original_steps
        PipelineEngine._INSTRUCTION_MAP[S.ReduceGrads] = original_reduce


def test_diffusion_pipe(tmp_path):
    for result in run_distributed(_diffusion_pipe, 2, args=(str(tmp_path), ), timeout=180):
        assert result["worst"] < 1e-6 and result["reduce_calls"] == 3 and result["client"] == 3, result
        assert result["restored"] == 0.0 and result["frozen_moved"] == 0.0 and result["eval"] < 1e-6, result


# ------------------------------------------------------------------------------------------------ qlora-pipe
def _qlora_pipe():
    import deepspeed.comm as dist
    from deepspeed.runtime import utils as ds_utils
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe import p2p, schedule
    from deepspeed.runtime.pipe.engine import TRAIN_BATCH_TIMER, PipelineEngine
    from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.schedule import BufferOpInstruction, TrainSchedule
    from deepspeed.runtime.pipe.topology import ProcessTopology
    from deepspeed.runtime.utils import PartitionedTensor  # noqa: F401  (qlora-pipe imports it)

    class ColumnMajorParallelTopology(ProcessTopology):

        def __init__(self, num_pp, num_dp):
            super().__init__(axes=["data", "pipe"], dims=[num_dp, num_pp])

    class SeededLinear(torch.nn.Linear):

        def __init__(self, seed):
            super().__init__(D, D)
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                self.weight.copy_(torch.randn(D, D, generator=g) * 0.3)
                self.bias.copy_(torch.randn(D, generator=g) * 0.3)

    class MyLayerSpec(LayerSpec):

        def build(self):
            return self.typename(**self.module_kwargs)

    class NoteBuffer(BufferOpInstruction):
        """An instruction of the project's own (as its DPO reference-logits pass)."""

    noted = []

    class NotingSchedule(TrainSchedule):

        def steps(self):
            for cmds in super().steps():
                extra = [NoteBuffer(c.buffer_id) for c in cmds if isinstance(c, schedule.ForwardPass)]
                yield cmds + extra

    class CustomPipelineEngine(PipelineEngine):

        def train_batch(self):
            self.timers(TRAIN_BATCH_TIMER).start()
            self.reset_activation_shape()
            self.module.train()
            self._compute_loss = True
            self._exec_schedule(
                NotingSchedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id))
            losses = self._aggregate_total_losses()
            self.timers(TRAIN_BATCH_TIMER).stop()
            return losses

        def _aggregate_total_losses(self):
            if self.is_last_stage():
                total = torch.stack([out[0] for out in self.fwd_outputs]).mean().reshape(1)
                if self.is_data_parallel:
                    dist.all_reduce(total, group=self.grid.get_data_parallel_group())
                    total /= self.grid.get_data_parallel_world_size()
                src = self.global_rank
            else:
                total = torch.zeros(1)
                src = self.grid.stage_to_global(self.num_stages - 1)
            dist.broadcast(total, src=src, group=self.grid.get_pipe_parallel_group())
            return total

        def _exec_forward_pass(self, buffer_id):
            self.tput_timer.start()
            self.mem_status("BEFORE FWD", reset_max=True)
            inputs = self.pipe_buffers["inputs"][buffer_id]
            inputs = inputs.clone() if torch.is_tensor(inputs) else tuple(t.clone() for t in inputs)
            assert not self.is_pipe_partitioned
            outputs = super(PipelineEngine, self).forward(inputs)
            self.pipe_buffers["outputs"][buffer_id] = outputs
            if self.is_last_stage():
                self.loss = self.module.loss_fn(outputs, self.pipe_buffers["labels"][buffer_id])
                self.fwd_outputs.append([self.loss.detach()])

        def _exec_note_buffer(self, buffer_id):
            noted.append(buffer_id)

    CustomPipelineEngine._INSTRUCTION_MAP = dict(PipelineEngine._INSTRUCTION_MAP)
    CustomPipelineEngine._INSTRUCTION_MAP[schedule.ForwardPass] = CustomPipelineEngine._exec_forward_pass
    CustomPipelineEngine._INSTRUCTION_MAP[NoteBuffer] = CustomPipelineEngine._exec_note_buffer

    specs = [MyLayerSpec(SeededLinear, seed=i) for i in range(4)]
    reference = torch.nn.Sequential(*[s.build() for s in specs])
    topology = ColumnMajorParallelTopology(num_pp=2, num_dp=2)
    model = PipelineModule(specs, topology=topology, loss_fn=torch.nn.functional.mse_loss, partition_method="uniform")
    assert model._find_layer_type("seededlinear") == [0, 1, 2, 3] and ds_utils.partition_uniform(4, 2) == [0, 2, 4]
    assert model._count_layer_params() == [20] * 4 and ds_utils.partition_balanced([20] * 4, 2) == [0, 2, 4]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "optimizer": _sgd(),
        "steps_per_print": 10**6,
        "zero_optimization": {
            "stage": 1
        }
    }
    engine = CustomPipelineEngine(args=None,
                                  model=model,
                                  mpu=model.mpu(),
                                  config=config,
                                  config_class=DeepSpeedConfig(config, model.mpu()))
    engine.set_dataloader([])  # qlora-pipe's set_dataloader is its own; the iterator comes next
    dp, dp_rank = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
    worst = 0.0
    for step in range(2):
        batches = _batches(step, 4, seed=1)  # 2 replicas x 2 micro-batches
        engine.set_dataiterator(iter(batches[dp_rank * 2:dp_rank * 2 + 2]))
        loss = float(engine.train_batch())
        worst = max(worst, abs(loss - _reference_step(reference, batches)), _compare(engine, reference))
    # the last stage sends to the first directly (qlora-pipe's sampling loop)
    ids = torch.full((2, 1), 7 if engine.is_last_stage() else -1, dtype=torch.int64)
    if engine.is_last_stage():
        p2p.send(ids, 0)
    if engine.is_first_stage():
        p2p.recv(ids, engine.num_stages - 1)
    layout = (engine.stage_id, dp_rank, dist.get_rank())
    engine.destroy()
    return dict(worst=worst, noted=len(noted), ids=int(ids[0, 0]), layout=layout, dp=dp)


def test_qlora_pipe():
    results = run_distributed(_qlora_pipe, 4, timeout=180)
    # column-major (axes data, pipe): neighbouring ranks are the stages of one pipeline
    assert [r["layout"] for r in results] == [(0, 0, 0), (1, 0, 1), (0, 1, 2), (1, 1, 3)]
    for r in results:
        assert r["worst"] < 1e-6 and r["noted"] == 4 and r["dp"] == 2, r
    assert results[0]["ids"] == 7 and results[2]["ids"] == 7


# ------------------------------------------------------------------------------------------------ GPT-NeoX
class Embed(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(D, D)

    def forward(self, inputs):
        tokens, position_ids, mask = inputs
        return self.proj(tokens + position_ids.unsqueeze(-1).float()), mask


class ParallelTransformerLayerPipe(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(D, D)

    def forward(self, inputs):
        hidden, mask = inputs
        return torch.tanh(self.fc(hidden)) * mask.unsqueeze(-1), mask


def _head(inputs):
    return inputs[0]


def _gpt_neox():
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    class GPT2ModelPipe(PipelineModule):
        pass

    torch.manual_seed(0)
    layers = [Embed(), ParallelTransformerLayerPipe(), ParallelTransformerLayerPipe(), _head]
    reference_layers = copy.deepcopy(layers)

    def reference(tokens, position_ids, mask):
        x = (tokens, position_ids, mask)
        for layer in reference_layers:
            x = layer(x)
        return x

    model = GPT2ModelPipe(layers,
                          topology=PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=1),
                          loss_fn=torch.nn.functional.mse_loss,
                          partition_method="type:transformer",
                          activation_checkpoint_interval=1)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "optimizer": _sgd(),
        "steps_per_print": 10**6
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    assert engine.has_attention_mask  # upstream keys it on the class name
    engine.set_has_attention_mask(True)

    def batch_fn(raw):  # GPT-NeoX: the data becomes ((tokens, position ids, bool mask), labels)
        if raw is None:
            return None
        x, y = raw
        position_ids = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        return (x, position_ids, x[..., 0] > -0.5), y

    engine.set_batch_fn(batch_fn)
    worst = 0.0
    params = [p for layer in reference_layers if isinstance(layer, torch.nn.Module) for p in layer.parameters()]
    for step in range(2):
        batches = _batches(step, 2, seed=2)
        loss = float(engine.train_batch(iter(batches)))
        total = sum(torch.nn.functional.mse_loss(reference(*batch_fn(b)[0]), b[1]) for b in batches) / 2
        grads = torch.autograd.grad(total, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= 0.1 * g
        worst = max(worst, abs(loss - float(total)))
    # text generation: one micro-batch, outputs of the last stage, the cached shapes reset by hand
    engine.micro_batches = 1
    engine.first_output_send = True
    engine.pipe_recv_buf = None
    engine.reset_activation_shape()
    sample = _batches(5, 1, seed=2)
    loss, logits = engine.eval_batch(iter(sample), return_logits=True)
    with torch.no_grad():
        expected = reference(*batch_fn(sample[0])[0])
    logits_err = float((logits - expected).abs().max()) if engine.is_last_stage() else 0.0
    first_stage_ranks = [engine.grid.stage_to_global(s) for s in range(engine.num_stages)]
    pipe = engine.is_pipe_parallel
    engine.destroy()
    return dict(worst=worst, logits=logits_err, ranks=first_stage_ranks, pipe=pipe)


def test_gpt_neox():
    for result in run_distributed(_gpt_neox, 2, timeout=180):
        assert result["worst"] < 1e-6 and result["logits"] < 1e-6, result
        assert result["ranks"] == [0, 1] and result["pipe"], result
