# SPDX-License-Identifier: Apache-2.0
"""Activation checkpointing: checkpointed gradients equal plain autograd's, RNG streams included."""

import json

import pytest
import torch

import deepspeed.runtime.activation_checkpointing.checkpointing as ckpt
from deepspeed.accelerator import get_accelerator


def _device():
    """The accelerator's device: the RNG tracker forks the accelerator's generator, so the work runs there."""
    return get_accelerator().current_device_name()


@pytest.fixture(autouse=True)
def restore_module_state():
    """configure() and the RNG tracker are process-wide: put them back after each test."""
    saved = (ckpt._configured, ckpt._mpu, dict(ckpt._options), ckpt.get_cuda_rng_tracker().get_states(),
             set(ckpt.get_cuda_rng_tracker().seeds_), ckpt._store)
    yield
    ckpt._configured, ckpt._mpu, ckpt._options, ckpt._store = saved[0], saved[1], saved[2], saved[5]
    tracker = ckpt.get_cuda_rng_tracker()
    tracker.set_states(saved[3])
    tracker.seeds_ = saved[4]


class Block(torch.nn.Module):

    def __init__(self, width=8, use_tracker=False):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)
        self.dropout = torch.nn.Dropout(p=0.5)
        self.use_tracker = use_tracker

    def forward(self, x, scale=1.0):
        h = torch.nn.functional.gelu(self.fc1(x))
        if self.use_tracker:
            with ckpt.get_cuda_rng_tracker().fork():
                h = self.dropout(h)
        else:
            h = self.dropout(h)
        return self.fc2(h) * scale, h.sum()


def _run(block, x, wrap, seed):
    """Forward (twice, to stack two blocks' RNG use) and backward; return outputs and every gradient."""
    torch.manual_seed(seed)
    if block.use_tracker:
        ckpt.get_cuda_rng_tracker().reset()
        ckpt.model_parallel_cuda_manual_seed(seed)
    x = x.detach().clone().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    out, aux = wrap(block, x, 0.5)
    out2, aux2 = wrap(block, out, 2.0)
    loss = (out2**2).sum() + aux + aux2
    loss.backward()
    grads = [x.grad] + [p.grad for p in block.parameters()]
    tracker_states = ckpt.get_cuda_rng_tracker().get_states()
    return [out2.detach(), loss.detach()] + grads, tracker_states, torch.rand(3, device=_device())


def _plain(block, *args):
    return block(*args)


@pytest.mark.parametrize("use_tracker", [False, True], ids=["torch_rng", "tracker_rng"])
@pytest.mark.parametrize("checkpoint_fn", [ckpt.checkpoint, ckpt.non_reentrant_checkpoint])
def test_gradients_match_plain_autograd(checkpoint_fn, use_tracker):
    torch.manual_seed(0)
    block = Block(use_tracker=use_tracker).to(_device())
    x = torch.randn(4, 8, device=_device())
    expected, expected_states, expected_next = _run(block, x, _plain, seed=11)
    actual, actual_states, actual_next = _run(block, x, checkpoint_fn, seed=11)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
    # Recomputation must not advance any RNG stream beyond what the plain run consumed.
    assert expected_states.keys() == actual_states.keys()
    for name in expected_states:
        assert torch.equal(actual_states[name], expected_states[name])
    torch.testing.assert_close(actual_next, expected_next)


def test_dropout_is_active():
    """Guard for the test above: different seeds must give different results, or it compares nothing."""
    torch.manual_seed(0)
    block = Block().to(_device())
    x = torch.randn(4, 8, device=_device())
    first, _, _ = _run(block, x, _plain, seed=1)
    second, _, _ = _run(block, x, _plain, seed=2)
    assert not torch.allclose(first[0], second[0])


def test_tracker_fork_isolates_its_stream():
    device = _device()
    tracker = ckpt.RNGStatesTracker()
    tracker.add("mp", 99)
    with pytest.raises(RuntimeError, match="already exists"):
        tracker.add("mp", 100)
    with pytest.raises(RuntimeError, match="already exists"):
        tracker.add("other", 99)
    with pytest.raises(RuntimeError, match="not added"):
        with tracker.fork("missing"):
            pass

    torch.manual_seed(5)
    outside_reference = torch.rand(3, device=device), torch.rand(3, device=device)
    torch.manual_seed(99)
    inside_reference = torch.rand(2, device=device), torch.rand(2, device=device)

    torch.manual_seed(5)
    first_outside = torch.rand(3, device=device)
    with tracker.fork("mp"):
        first_inside = torch.rand(2, device=device)
    second_outside = torch.rand(3, device=device)
    with tracker.fork("mp"):
        second_inside = torch.rand(2, device=device)
    torch.testing.assert_close((first_outside, second_outside), outside_reference)
    torch.testing.assert_close((first_inside, second_inside), inside_reference)


def test_model_parallel_seed_uses_tensor_parallel_rank():

    class MPU:

        def get_model_parallel_rank(self):
            return 3

    device = _device()
    ckpt.configure(mpu_=MPU())
    ckpt.model_parallel_cuda_manual_seed(7)
    with ckpt.get_cuda_rng_tracker().fork():
        drawn = torch.rand(4, device=device)
    torch.manual_seed(7 + 2718 + 3)
    torch.testing.assert_close(drawn, torch.rand(4, device=device))


def test_configure_sources_and_overrides(tmp_path):
    section = {"partition_activations": True, "cpu_checkpointing": True, "number_checkpoints": 4, "profile": True}
    ckpt.configure(deepspeed_config={"activation_checkpointing": section}, profile=False)
    assert ckpt.is_configured()
    config = ckpt.get_config()
    assert config["partition_activations"] and config["checkpoint_in_cpu"]
    assert config["num_checkpoints"] == 4 and config["profile"] is False
    assert config["contiguous_checkpointing"] is False and config["synchronize"] is False

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"activation_checkpointing": {"synchronize_checkpoint_boundary": True}}))
    ckpt.configure(deepspeed_config=str(path))
    assert ckpt.get_config()["synchronize"] is True and ckpt.get_config()["partition_activations"] is False

    class EngineConfig:
        activation_checkpointing_config = {
            "contiguous_memory_optimization": True,
            "partition_activations": True,
            "number_checkpoints": 2
        }

    ckpt.configure(None, deepspeed_config=EngineConfig())
    assert ckpt.get_config()["contiguous_checkpointing"] is True

    with pytest.raises(ValueError, match="partition_activations"):
        ckpt.configure(contiguous_checkpointing=True)
    with pytest.raises(ValueError, match="num_checkpoints"):
        ckpt.configure(contiguous_checkpointing=True, partition_activations=True)

    ckpt.reset()  # releases buffers only: the configuration stays
    assert ckpt.is_configured()
