# SPDX-License-Identifier: Apache-2.0
"""``engine.pipeline_parallelism``: True for the engine of a ``PipelineModule``, False otherwise; a pipeline engine
refuses ``coalesce_grad_reduction()`` (its ``train_batch()`` reduces the gradients once per batch), naming why."""

import torch

from tests.unit.common import run_distributed

CONFIG = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6}


def _flags():
    import deepspeed
    from deepspeed.pipe import PipelineModule
    torch.manual_seed(0)
    layers = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    pipe, _, _, _ = deepspeed.initialize(model=PipelineModule(layers, num_stages=2, loss_fn=torch.nn.MSELoss()),
                                         config=dict(CONFIG, optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    plain, _, _, _ = deepspeed.initialize(model=torch.nn.Linear(2, 2),
                                          config=dict(CONFIG, optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    try:
        with pipe.coalesce_grad_reduction():
            pass
        refused = None
    except NotImplementedError as exc:
        refused = str(exc)
    with plain.coalesce_grad_reduction():
        pass
    return pipe.pipeline_parallelism, plain.pipeline_parallelism, refused


def test_pipeline_flag_and_coalescing_refused():
    for pipe, plain, refused in run_distributed(_flags, 2):
        assert (pipe, plain) == (True, False)
        assert refused is not None and "pipeline parallelism" in refused
