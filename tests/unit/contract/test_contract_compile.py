# SPDX-License-Identifier: Apache-2.0
"""The gradient contract under torch.compile (inductor, on the CPU), on every stage, both entry points.

``torch.compile(model)`` before ``deepspeed.initialize`` and ``engine.compile()`` after it; the
reference is the uncompiled plain-torch model. ZeRO-3 gathers and releases parameters in module
hooks that compiled code runs eagerly (graph breaks), so the compiled regions always see whole
parameters. Compiling costs tens of seconds per new graph on two cores; the worker processes keep
their compiled code, so the cells after the first of each graph are fast.
"""

import itertools

import pytest

from tests.unit.common import run_distributed
from tests.unit.contract.runner import run_cell

CELLS = [
    dict(stage=stage, shape=shape, gas=gas, compile=entry)
    for stage, (shape, gas), entry in itertools.product([0, 1, 2, 3], [("plain", 1), (
        "module_twice", 1), ("mixed_submodule", 1), ("plain", 4)], ["torch", "engine"])
]

# ``"compile": {"deepcompile": true}`` runs the same compiled path (engine.compile()); a ZeRO pass named in
# ``passes`` is the config's own stage.
_PASSES = {0: None, 1: ["z1"], 2: ["z1"], 3: ["z3"]}
CELLS += [
    dict(stage=stage,
         shape="plain",
         gas=1,
         compile="engine",
         zero_extra_top={
             "compile": dict({"deepcompile": True}, **({
                 "passes": _PASSES[stage]
             } if _PASSES[stage] else {}))
         }) for stage in (0, 1, 2, 3)
]


def _cell_id(c):
    deep = "-deepcompile" if "zero_extra_top" in c else ""
    return f"z{c['stage']}-{c['shape']}-gas{c['gas']}-{c['compile']}{deep}"


@pytest.mark.parametrize("cell", CELLS, ids=[_cell_id(c) for c in CELLS])
def test_contract_compiled(cell):
    cell = dict(cell, dtype="fp32")
    if cell["stage"] == 3:
        cell["zero_extra"] = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 100}
    checked = run_distributed(run_cell, 2, args=(cell, ), timeout=600)
    assert all(c >= 2 for c in checked), checked


def compile_options_rejected():
    import deepspeed
    import torch
    from tests.unit.contract.models import ToyNet
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine = deepspeed.initialize(model=ToyNet(), config=cfg)[0]
    try:
        with pytest.raises(NotImplementedError, match="compiled_autograd"):
            engine.compile(compiled_autograd_enabled=True)
        with pytest.raises(NotImplementedError, match="DeepCompile"):
            engine.compile(schedule=[])
        assert not engine.is_compiled
    finally:
        engine.destroy()
    return True


def test_compile_options_rejected():
    assert run_distributed(compile_options_rejected, 1, timeout=60) == [True]


def deepcompile_keys_refused(section, stage):
    """``initialize`` raises on every rank, before any collective, naming the key."""
    import deepspeed
    from tests.unit.contract.models import ToyNet
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "compile": section}
    try:
        deepspeed.initialize(model=ToyNet(), config=cfg)
    except (NotImplementedError, ValueError) as error:
        return str(error)
    return None


@pytest.mark.parametrize("section,stage,words", [
    ({
        "deepcompile": True,
        "offload_activation": True
    }, 3, "compile.offload_activation"),
    ({
        "deepcompile": True,
        "offload_opt_states": True
    }, 1, "compile.offload_opt_states"),
    ({
        "deepcompile": True,
        "free_activation": True
    }, 2, "compile.free_activation"),
    ({
        "deepcompile": True,
        "double_buffer": False
    }, 3, "compile.double_buffer"),
    ({
        "deepcompile": True,
        "symmetric_memory": True
    }, 3, "compile.symmetric_memory"),
    ({
        "deepcompile": True,
        "offload_parameters": True
    }, 3, "compile.offload_parameters"),
    ({
        "deepcompile": True,
        "passes": ["autosp"]
    }, 3, "autosp"),
    ({
        "deepcompile": True,
        "passes": ["z3"]
    }, 1, "zero_optimization.stage is 1"),
    ({
        "deepcompile": True,
        "made_up": 1
    }, 0, "compile.made_up"),
])
def test_deepcompile_keys_refused_by_name(section, stage, words):
    messages = run_distributed(deepcompile_keys_refused, 2, args=(section, stage), timeout=60)
    assert all(m is not None and words in m for m in messages), messages
