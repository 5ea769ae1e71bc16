# SPDX-License-Identifier: Apache-2.0
"""A model whose tensor-parallel layers are built by hand (``module_inject.layers.LinearLayer`` /
``LinearAllreduce`` over the tensor-parallel group) before ``deepspeed.initialize``: every rank keeps its own piece
(initialize does not overwrite it with another rank's), and one SGD step equals the unsharded model's step in plain
torch, piece by piece."""

import torch

from tests.unit.common import run_distributed

TP = 2
D = 8


class _Net(torch.nn.Module):

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(D, 2 * D)
        self.down = torch.nn.Linear(2 * D, D)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _run():
    import deepspeed
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer
    from deepspeed.utils import groups
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "tensor_parallel": {
            "autotp_size": TP,
            "partition_config": {
                "use_default_specs": False,
                "layer_specs": [{
                    "patterns": [r".*\.weight$"],
                    "partition_type": "skip"
                }]
            }
        },
    }
    # the first initialize builds the groups the layers are cut over
    deepspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    group = groups.get_tensor_model_parallel_group()
    tp_rank = torch.distributed.get_rank(group=group)

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, D, generator=g), torch.randn(2, D, generator=g)
    reference = _Net()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p.sub_(0.1 * p.grad)

    model = _Net()
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.up = LinearLayer(model.up, group)
    model.down = LinearAllreduce(model.down, group)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def piece(name, tensor):  # this rank's part of a whole tensor
        if name.startswith("up."):
            return tensor.chunk(TP, 0)[tp_rank]
        return tensor.chunk(TP, 1)[tp_rank] if name == "down.weight" else tensor

    kept = all(torch.equal(p.detach(), piece(n, whole[n])) for n, p in engine.module.named_parameters())
    loss = engine(x)
    loss = torch.nn.functional.mse_loss(loss, y)
    engine.backward(loss)
    engine.step()
    ref = dict(reference.named_parameters())
    diffs = {
        n: float((p.detach() - piece(n, ref[n].detach())).abs().max())
        for n, p in engine.module.named_parameters()
    }
    return kept, diffs


def test_hand_built_layers_keep_their_pieces_and_train_as_the_whole_model():
    for kept, diffs in run_distributed(_run, 4):
        assert kept
        assert max(diffs.values()) < 1e-6, diffs
