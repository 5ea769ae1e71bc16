# SPDX-License-Identifier: Apache-2.0
"""The host Adam op (built just in time with the machine's C++ compiler) against torch.optim.Adam/AdamW.

DeepSpeedCPUAdam with the op must give torch's results to float32 rounding, write the bf16/fp16 copy of the
updated parameters exactly as a cast of them, keep torch's state layout (a checkpoint moves between the op and
torch's kernels), leave unsupported cases to torch, and fall back to torch with a note where no compiler exists.
The op is built once per machine (about ten seconds on two cores) and cached; the tests skip only when the
machine has no C++ compiler.
"""

import pytest
import torch

from deepspeed.ops.adam import DeepSpeedCPUAdam, host_adam
from deepspeed.ops.native import forget_errors, load_error
from deepspeed.ops.op_builder import OpBuilder
from deepspeed.ops.op_builder import builder as builder_module

SIZES = [1, 7, 4097, 100003]
HYPER = dict(lr=2e-2, betas=(0.9, 0.95), eps=1e-8)


@pytest.fixture(scope="module")
def host_op():
    if builder_module.cxx_compiler() is None:
        pytest.skip("no C++ compiler on this machine: the host Adam op cannot be built (torch's kernels run)")
    op = host_adam.host_adam_op()
    assert op is not None, f"the host Adam op did not build: {load_error('cpu_adam')}"
    return op


@pytest.fixture
def count_op_steps(monkeypatch):
    calls = []
    real = host_adam.adam_step

    def counting(*args, **kwargs):
        calls.append(args[2].numel())
        return real(*args, **kwargs)

    monkeypatch.setattr(host_adam, "adam_step", counting)
    return calls


def problem(seed, steps=3):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    grads = [[torch.randn(n, generator=gen) for n in SIZES] for _ in range(steps)]
    return params, grads


def run(optimizer, params, grads, targets=None):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        if targets is None:
            optimizer.step()
        else:
            optimizer.step(fp16_param_groups=[targets])


def assert_matches(actual, expected):
    for a, b in zip(actual, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    diff = torch.cat([(a - b).reshape(-1) for a, b in zip(actual, expected)])
    ref = torch.cat([b.reshape(-1) for b in expected])
    assert float(diff.norm() / ref.norm()) < 1e-6


@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16, torch.float16], ids=["no-copy", "bf16", "fp16"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_matches_torch(host_op, count_op_steps, monkeypatch, adamw, weight_decay, copy_dtype):
    monkeypatch.setenv("DS_NATIVE_CPU_ADAM", "1")
    initial, grads = problem(seed=int(adamw) * 10 + int(weight_decay * 10))
    ours = [torch.nn.Parameter(p.clone()) for p in initial]
    theirs = [torch.nn.Parameter(p.clone()) for p in initial]
    targets = None if copy_dtype is None else [torch.empty(n, dtype=copy_dtype) for n in SIZES]
    optimizer = DeepSpeedCPUAdam(ours, weight_decay=weight_decay, adamw_mode=adamw, **HYPER)
    reference = (torch.optim.AdamW if adamw else torch.optim.Adam)(theirs,
                                                                   weight_decay=weight_decay,
                                                                   foreach=False,
                                                                   **HYPER)
    run(optimizer, ours, grads, targets)
    run(reference, theirs, grads)
    assert len(count_op_steps) == len(SIZES) * len(grads), "every update must have gone through the op"
    assert_matches([p.detach() for p in ours], [p.detach() for p in theirs])
    for p, q in zip(ours, theirs):
        mine, torch_state = optimizer.state[p], reference.state[q]
        assert float(mine["step"]) == float(torch_state["step"]) == len(grads)
        assert_matches([mine["exp_avg"], mine["exp_avg_sq"]], [torch_state["exp_avg"], torch_state["exp_avg_sq"]])
    if targets is not None:
        for p, target in zip(ours, targets):
            assert torch.equal(target, p.detach().to(copy_dtype)), "the copy must be the cast of the result"


def test_default_policy_uses_the_op_for_steps_that_copy(host_op, count_op_steps, monkeypatch):
    monkeypatch.delenv("DS_NATIVE_CPU_ADAM", raising=False)
    params, grads = problem(seed=3, steps=1)
    params = [torch.nn.Parameter(p) for p in params]
    optimizer = DeepSpeedCPUAdam(params, **HYPER)
    run(optimizer, params, grads)
    assert count_op_steps == [], "a step without a copy stays on torch's fused kernel by default"
    run(optimizer, params, grads, targets=[torch.empty(n, dtype=torch.bfloat16) for n in SIZES])
    assert count_op_steps == SIZES
    monkeypatch.setenv("DS_NATIVE_CPU_ADAM", "0")
    run(optimizer, params, grads, targets=[torch.empty(n, dtype=torch.bfloat16) for n in SIZES])
    assert count_op_steps == SIZES, "DS_NATIVE_CPU_ADAM=0 keeps every step on torch"


def test_state_moves_between_op_and_torch(host_op, monkeypatch):
    initial, grads = problem(seed=5, steps=4)
    reference_params = [torch.nn.Parameter(p.clone()) for p in initial]
    run(torch.optim.AdamW(reference_params, weight_decay=0.1, foreach=False, **HYPER), reference_params, grads)

    monkeypatch.setenv("DS_NATIVE_CPU_ADAM", "1")
    first = [torch.nn.Parameter(p.clone()) for p in initial]
    optimizer = DeepSpeedCPUAdam(first, weight_decay=0.1, **HYPER)
    run(optimizer, first, grads[:2])
    saved = optimizer.state_dict()
    monkeypatch.setenv("DS_NATIVE_CPU_ADAM", "0")
    second = [torch.nn.Parameter(p.detach().clone()) for p in first]
    resumed = DeepSpeedCPUAdam(second, weight_decay=0.1, **HYPER)
    resumed.load_state_dict(saved)
    run(resumed, second, grads[2:])
    assert_matches([p.detach() for p in second], [p.detach() for p in reference_params])


def test_unsupported_updates_stay_on_torch(host_op, count_op_steps, monkeypatch):
    monkeypatch.setenv("DS_NATIVE_CPU_ADAM", "1")
    initial, grads = problem(seed=7)
    ours = [torch.nn.Parameter(p.clone()) for p in initial]
    theirs = [torch.nn.Parameter(p.clone()) for p in initial]
    run(DeepSpeedCPUAdam(ours, amsgrad=True, **HYPER), ours, grads)
    run(torch.optim.AdamW(theirs, amsgrad=True, weight_decay=0.0, foreach=False, **HYPER), theirs, grads)
    assert count_op_steps == []
    assert_matches([p.detach() for p in ours], [p.detach() for p in theirs])
    low = [torch.nn.Parameter(torch.randn(9).to(torch.bfloat16))]
    low[0].grad = torch.randn(9).to(torch.bfloat16)
    DeepSpeedCPUAdam(low, **HYPER).step()
    assert count_op_steps == [], "a bf16 parameter is stepped in float32 by torch"


def test_op_rejects_bad_arguments(host_op):
    assert host_op.adam_step(0, 0, 0, 0, -1, 1e-3, 0.9, 0.99, 1e-8, 0.0, True, 0.1, 0.1, 0, 0, 1) != ""
    assert "without a buffer" in host_op.adam_step(0, 0, 0, 0, 4, 1e-3, 0.9, 0.99, 1e-8, 0.0, True, 0.1, 0.1, 0, 1, 1)
    param = torch.zeros(4)
    state = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(4, dtype=torch.float64), "exp_avg_sq": torch.zeros(4)}
    group = dict(HYPER, weight_decay=0.0, decoupled_weight_decay=True)
    with pytest.raises(ValueError, match="moments"):
        host_adam.adam_step(host_op, group, param, torch.ones(4), state)
    assert float(state["step"]) == 0.0, "a rejected update changes nothing"


def test_falls_back_without_a_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("DS_NATIVE_CPU_ADAM", "1")
    monkeypatch.delitem(OpBuilder._loaded_ops, "cpu_adam", raising=False)
    forget_errors()
    try:
        assert host_adam.host_adam_op() is None
        assert "no C++ compiler" in load_error("cpu_adam")
        initial, grads = problem(seed=9)
        ours = [torch.nn.Parameter(p.clone()) for p in initial]
        theirs = [torch.nn.Parameter(p.clone()) for p in initial]
        targets = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
        run(DeepSpeedCPUAdam(ours, **HYPER), ours, grads, targets)
        run(torch.optim.AdamW(theirs, weight_decay=0.0, foreach=False, **HYPER), theirs, grads)
        assert_matches([p.detach() for p in ours], [p.detach() for p in theirs])
        for p, target in zip(ours, targets):
            assert torch.equal(target, p.detach().to(torch.bfloat16))
    finally:
        forget_errors()
