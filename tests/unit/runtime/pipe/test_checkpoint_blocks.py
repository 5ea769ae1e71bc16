# SPDX-License-Identifier: Apache-2.0
"""``PipelineModule.is_checkpointable_results``: per block of ``activation_checkpoint_interval`` layers, whether
``forward`` checkpoints it (a block holding parameters is checkpointed); it follows ``set_checkpoint_interval``, and
the output stays that of the same layers run in plain torch."""

import torch

from tests.unit.common import run_distributed


def _layers():
    torch.manual_seed(0)
    return [torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Tanh()]


def _blocks():
    from deepspeed.pipe import PipelineModule
    x = torch.randn(3, 4)
    reference = torch.nn.Sequential(*_layers())(x)
    model = PipelineModule(_layers(), num_stages=1, activation_checkpoint_interval=2)
    seen = [model.is_checkpointable_results]
    outputs = [model(x)]
    for interval in (1, 0, 3):
        model.set_checkpoint_interval(interval)
        fresh = PipelineModule(_layers(), num_stages=1, activation_checkpoint_interval=interval)
        assert model.is_checkpointable_results == fresh.is_checkpointable_results
        seen.append(model.is_checkpointable_results)
        outputs.append(model(x))
    return seen, all(torch.allclose(out, reference) for out in outputs)


def test_checkpointable_blocks_follow_the_interval():
    seen, same_output = run_distributed(_blocks, 1)[0]
    assert seen == [[True, True, False], [True, False, True, False, False], [], [True, False]]
    assert same_output
