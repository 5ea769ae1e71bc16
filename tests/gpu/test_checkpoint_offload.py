# SPDX-License-Identifier: Apache-2.0
"""``cpu_checkpointing`` on one GPU: the asynchronous path (side stream, pinned pooled buffers, events, the copy back
of the previous input prefetched in backward) gives the gradients of plain checkpointing bit for bit, and the layer
inputs really leave device memory.

Per case (reentrant ``checkpoint`` and ``non_reentrant_checkpoint``): a stack of Linear + GELU + dropout layers, each
under a checkpoint, trained once with plain ``torch.utils.checkpoint`` and once with ours configured with
``checkpoint_in_cpu``; outputs and every gradient must be equal, and ``torch.cuda.memory_allocated`` after the
forward must be lower by at least the bytes of the layer inputs but the first (the caller holds it) and the last
(kept on the device).

* ``python -m pytest tests/gpu/test_checkpoint_offload.py``: skipped without CUDA;
* ``python -m tests.gpu.test_checkpoint_offload``: one line per case, then ``N passed, M failed``.
"""

import copy
import os
import sys
import traceback

import pytest
import torch
import torch.utils.checkpoint

pytestmark = pytest.mark.gpu

LAYERS, WIDTH, BATCH = 8, 1024, 512
# DS_GPU_TESTS_ON_CPU=1: a check of this file's logic on the host (host tensors offloaded, no memory figures)
ON_CPU = os.environ.get("DS_GPU_TESTS_ON_CPU") == "1"
DEVICE = "cpu" if ON_CPU else "cuda"


def _layers():
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Dropout(0.1))
        for _ in range(LAYERS)).to(DEVICE)


def _train(layers, wrap):
    """Outputs and gradients, and the device memory the forward left allocated (the run's own growth, so that what
    an earlier run still holds, such as the reference's gradients, does not count)."""
    before = 0
    if not ON_CPU:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    torch.manual_seed(1)
    x = torch.randn(BATCH, WIDTH, device=DEVICE, requires_grad=True)
    h = x
    for layer in layers:
        h = wrap(layer, h)
    after_forward = 0
    if not ON_CPU:
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # the allocator frees the blocks whose copies completed (record_stream)
        after_forward = torch.cuda.memory_allocated() - before
    h.square().mean().backward()
    if not ON_CPU:
        torch.cuda.synchronize()
    return [h.detach(), x.grad] + [p.grad for p in layers.parameters()], after_forward


def check(reentrant):
    import deepspeed.runtime.activation_checkpointing.checkpointing as ckpt
    from deepspeed.runtime.activation_checkpointing import saved_inputs
    if ON_CPU:
        saved_inputs.needs_offload = lambda tensor: True
    layers = _layers()
    reference = copy.deepcopy(layers)
    plain = lambda layer, h: torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=reentrant)  # noqa: E731
    ckpt.configure(None, checkpoint_in_cpu=True)
    ours = ckpt.checkpoint if reentrant else ckpt.non_reentrant_checkpoint
    try:
        # a first run allocates what stays for the process (cuBLAS's workspace: 32 MiB on Hopper), outside both
        # measurements
        _train(copy.deepcopy(reference), plain)
        expected, plain_memory = _train(reference, plain)
        actual, our_memory = _train(layers, ours)
        stats = ckpt.get_input_store().stats
    finally:
        ckpt.configure(None)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert torch.equal(a, e), f"tensor {i} differs"
    freed = plain_memory - our_memory
    # the inputs of layers 1 .. LAYERS-2 (layer 0's is the caller's x, the last layer's stays on the device)
    inputs_bytes = (LAYERS - 2) * BATCH * WIDTH * 4
    if not ON_CPU:  # the host has no side stream: nothing is prefetched there
        assert freed >= inputs_bytes, f"only {freed} bytes freed, expected {inputs_bytes}"
        assert stats.prefetched > 0, stats
    assert stats.offloaded == LAYERS - 1 and stats.restored == LAYERS - 1, stats
    return f"freed {freed / 2**20:.1f} MiB after forward, {stats}"


CASES = {"reentrant": True, "non_reentrant": False}


@pytest.mark.skipif(not (ON_CPU or torch.cuda.is_available()), reason="needs CUDA")
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_checkpointing_on_gpu(name):
    check(CASES[name])


def main(argv):
    passed = failed = 0
    for name, reentrant in CASES.items():
        if argv and not any(s in name for s in argv):
            continue
        try:
            print(f"ok   {name}: {check(reentrant)}", flush=True)
            passed += 1
        except Exception:  # noqa: BLE001 - report every case
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
