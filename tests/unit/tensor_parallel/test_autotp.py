# SPDX-License-Identifier: Apache-2.0
"""Automatic tensor parallelism for training against the unsharded model in plain torch (gloo, CPU).

* The training matrix (``cases.py``): tiny random Llama, Mistral, Qwen2 and Qwen3 (and seeded random widths), tp 2 at
  world 2 and tp 2 x dp 2 / tp 4 at world 4, ZeRO 0-3, fp32 and bf16, SGD and Adam, GAS, clipping, with and
  without the model's tp_plan (partition rules from the plan or the heuristic), uneven vocabulary (65), MLP (66)
  and key/value heads (6 over 4 ranks), tied and untied heads: after every step the unsharded state, each rank's
  loss and the global norm equal the reference's, and replicated parameters are the same on every rank of a group
  (Qwen3's q_norm/k_norm on the heuristic path included: their gradient is summed over the group). The default
  run holds one case of every property and one seeded random cell (``DS_TP_MATRIX_SEED``, 3 by default);
  ``DS_FULL_MATRIX=1`` runs the product (every model x ZeRO stage x dtype x tp_plan or not x tied or not, at both
  worlds, and tp 4 for Mistral) and ten random seeds.
* Checkpoints (``ckpt_cases.py``): per-rank files in upstream's names, an exact resume, loads at tp 1, 2 and 4
  from the native tag and from its universal folder.
* The layers against ``nn.Linear``, the first-forward data check, bad input, tensor x sequence parallelism
  (``layer_cases.py``), the Trainer (resume included) and Accelerate (``framework_cases.py``).
"""

import os

import pytest
import torch

from tests.unit.common import run_distributed

T = 600

FULL = os.environ.get("DS_FULL_MATRIX") == "1"
MODELS = ("llama", "mistral", "qwen2", "qwen3")

# (args, kwargs) of cases.run_cell: (model, tp, zero stage); GAS 2 unless given. The default run holds one case of
# every property: each model, ZeRO 0-3, fp32 and bf16, SGD and Adam, clipping, the tp_plan and the heuristic,
# tied and untied heads, tp 2 at world 2, tp 4 (6 key/value heads over 4 ranks) and tp 2 x dp 2 at world 4,
# uneven vocabulary and MLP everywhere; plus one seeded cell of random widths and options (``_sampled``).
WORLD2 = [
    (("llama", 2, 0), {
        "optimizer": "adam"
    }),
    (("qwen3", 2, 1), {
        "hf_plan": False,
        "clip": 0.3
    }),
    (("qwen2", 2, 3), {
        "dtype": "bf16",
        "tied": True,
        "hf_plan": False
    }),
]
WORLD4 = [
    (("mistral", 4, 2), {}),
    # fp32: the q_norm/k_norm replicas see sharded heads, and a missing reduction of their gradient over the
    # tensor-parallel group moves them by about 1e-4, below bf16's resolution of a weight near 1
    (("qwen3", 2, 3), {
        "hf_plan": False,
        "clip": 0.3
    }),
]


def _options(r, dtype):
    """Random optimizer, clipping and GAS. Adam only in fp32: its first step moves every weight by about the learning
    rate times the sign of its gradient, so a bf16 gradient that rounds to the other side of zero (another summation
    order) moves a weight by twice the learning rate, which no tolerance separates from a wrong gradient."""
    return {
        "optimizer": r.choice(["sgd", "adam"]) if dtype == "fp32" else "sgd",
        "clip": r.choice([0.0, 0.3]),
        "gas": r.choice([1, 2]),
    }


def _sampled(seed, tp):
    """A seeded cell of random widths (``reference.random_widths``) and random options; a failing seed becomes a
    fixed case above."""
    import random
    r = random.Random(seed)
    stage, dtype = r.randrange(4), r.choice(["fp32", "bf16"])
    return (("random", tp, stage), {
        "seed": seed,
        "dtype": dtype,
        "tied": r.random() < 0.5,
        "hf_plan": r.random() < 0.5,
        **_options(r, dtype)
    })


def _product(tp):
    """``DS_FULL_MATRIX=1``: every model x ZeRO stage x dtype x tp_plan/heuristic x tied/untied, with seeded random
    options (``_options``), and ten seeds of random widths."""
    import itertools
    import random
    cells = []
    for i, (model, stage, dtype, hf_plan,
            tied) in enumerate(itertools.product(MODELS, range(4), ["fp32", "bf16"], [True, False], [False, True])):
        cells.append(((model, tp, stage), {
            "dtype": dtype,
            "hf_plan": hf_plan,
            "tied": tied,
            **_options(random.Random(i), dtype)
        }))
    return cells + [_sampled(seed, 2) for seed in range(10)]


SEED = int(os.environ.get("DS_TP_MATRIX_SEED", "3"))
MATRIX = {
    2: _product(2) if FULL else WORLD2 + [_sampled(SEED, 2)],
    4: _product(2) + [cell for cell in _product(4) if cell[0][0] == "mistral"] if FULL else WORLD4,
}


def _cells(cells):
    from tests.unit.tensor_parallel.cases import run_cells
    return run_cells(cells)


@pytest.mark.parametrize("world", [2, 4], ids=["world2", "world4"])
def test_training_equals_unsharded_model(world):
    cells = MATRIX[world]
    timeout = T + 20 * len(cells) if FULL else T
    assert run_distributed(_cells, world, args=(cells, ), timeout=timeout) == [[]] * world


def _layers_and_checks():
    from tests.unit.tensor_parallel import layer_cases
    return layer_cases.layer_checks(), layer_cases.data_checks(), layer_cases.bad_inputs()


def test_layers_data_check_and_bad_input():
    from deepspeed.runtime.tensor_parallel.data_check import MESSAGE as message
    results = run_distributed(_layers_and_checks, 2, timeout=T)
    for layers, data, bad in results:
        assert layers == []
        assert data == [message, "passed"]
        assert bad == results[0][2]  # the same error on every rank
    expected = {
        "the counter": "counted",
        "size not dividing the world": "ValueError",
        "more ranks than key/value heads": "ValueError",
        "unknown key": "DeepSpeedConfigError",
        "inference kernels": "NotImplementedError",
        "bad partition type": "DeepSpeedConfigError",
        "an embedding asked to be cut": "NotImplementedError",
        "offload": "NotImplementedError",
        "tp_model_init size differs": "ValueError",
        "tp_model_init dtype differs": "ValueError",
        "tp_group with mpu": "ValueError",
    }
    got = {name: (kind, calls) for name, kind, _, calls in results[0][2]}
    assert got.keys() == expected.keys()
    for name, kind in expected.items():
        calls = ["barrier"] if name == "the counter" else []
        assert got[name] == (kind, calls), (name, results[0][2])  # the error, and no collective before it


def _save(save_dir):
    from tests.unit.tensor_parallel.ckpt_cases import run
    return run(save_dir, "mistral", 2, 1, "fp32", 2, 1, save=True)


def _loads(save_dir, loads):
    from tests.unit.tensor_parallel.ckpt_cases import run
    out = []
    for tp, universal in loads:
        tag = "saved_universal" if universal else "saved"
        out.append(run(save_dir, "mistral", tp, 1, "fp32", 2, 1, load_from=tag, universal=universal)[:3])
    return out


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_checkpoint_resume_and_other_tensor_parallel_sizes(tmp_path):
    base, at_save, norm, files = run_distributed(_save, 2, args=(str(tmp_path), ), timeout=T)[0]
    assert files == [
        ".ds_complete", "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    ]
    assert os.path.isdir(tmp_path / "saved_universal" / "zero" / "lm_head.weight")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    assert _max_diff(get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="saved"), at_save) == 0.0
    # the same tensor-parallel size (every rank its own files: an exact resume); tp 1 (dp 2) from the native tag
    # and from the universal folder (the saved state, whole)
    resumed, native, universal = run_distributed(_loads,
                                                 2,
                                                 args=(str(tmp_path), [(2, False), (1, False), (1, True)]),
                                                 timeout=T)[0]
    assert _max_diff(resumed[1], at_save) == 0.0 and _max_diff(resumed[0], base) == 0.0 and resumed[2] == norm
    assert _max_diff(native[1], at_save) == 0.0 and _max_diff(universal[1], at_save) == 0.0
    # tp 4 (one data-parallel rank, the same batches): the saved state, and the next step as at tp 2
    (state, loaded, resumed_norm), = run_distributed(_loads, 4, args=(str(tmp_path), [(4, True)]), timeout=T)[0]
    assert _max_diff(loaded, at_save) == 0.0 and _max_diff(state, base) < 1e-6
    assert abs(resumed_norm - norm) < 1e-5 * norm


def _sequence_parallel():
    from tests.unit.tensor_parallel.layer_cases import with_sequence_parallel
    return with_sequence_parallel(2)


def test_tensor_and_sequence_parallel_compose():
    assert run_distributed(_sequence_parallel, 4, timeout=T) == [[]] * 4


def _trainer(tmp_dir):
    from tests.unit.tensor_parallel.framework_cases import run_trainer_case
    return run_trainer_case(2, 2, tmp_dir)


def _accelerate():
    from tests.unit.tensor_parallel.framework_cases import run_accelerate_case
    return run_accelerate_case(1, 2)


def test_trainer_and_accelerate_run_unchanged(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    assert run_distributed(_trainer, 2, args=(str(tmp_path), ), timeout=T) == [[]] * 2
    assert run_distributed(_accelerate, 4, timeout=T) == [[]] * 4


def test_sharding_rules_are_data():
    """The plan of each source, the layouts of uneven and fused cuts, and the config section (no ranks needed)."""
    from deepspeed.module_inject.layers import ShardLayout
    from deepspeed.runtime.tensor_parallel.config import get_tensor_parallel_config
    from deepspeed.runtime.tensor_parallel.plan import build_plan
    from tests.unit.tensor_parallel import reference as ref
    section = get_tensor_parallel_config({})
    assert (section.autotp_size, section.dtype, section.tp_overlap_comm, section.tensor_parallel.tp_grain_size,
            section.partition_config, section.preset_model) == (0, torch.float16, False, 1, None, None)
    config = get_tensor_parallel_config({"tensor_parallel": {"autotp_size": 2}})
    plans = {
        "tp_plan":
        build_plan(ref.build("qwen3"), config),
        "heuristic":
        build_plan(ref.build("qwen3", hf_plan=False), config),
        "preset":
        build_plan(ref.build("qwen3"),
                   get_tensor_parallel_config({"tensor_parallel": {
                       "autotp_size": 2,
                       "preset_model": "llama"
                   }}))
    }
    for source, plan in plans.items():
        assert plan.source == source
        kinds = {name.split(".")[-1]: rule.kind for name, rule in plan.layers.items()}
        assert kinds == {
            "q_proj": "column",
            "k_proj": "column",
            "v_proj": "column",
            "o_proj": "row",
            "gate_proj": "column",
            "up_proj": "column",
            "down_proj": "row",
            **({} if source == "preset" else {
                   "lm_head": "column"
               })
        }, source
    assert "model.layers.0.self_attn.q_norm.weight" in plans["tp_plan"].grad_sum
    # a tied head stays one parameter
    assert "lm_head" not in build_plan(ref.build("llama", tied=True), config).layers
    # seeded random cuts: every rank's piece reassembles the whole, fused sub-parameters each cut on their own
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        tp = int(torch.randint(1, 5, (1, ), generator=g))
        subs = [
            int(torch.randint(tp, 3 * tp + 2, (1, ), generator=g))
            for _ in range(int(torch.randint(1, 4, (1, ), generator=g)))
        ]
        dim = int(torch.randint(0, 2, (1, ), generator=g))
        shape = [sum(subs), 5] if dim == 0 else [3, sum(subs)]
        layout = ShardLayout.cut(shape, dim, tp, "mlp.fused", subs)
        whole = torch.randn(shape, generator=g)
        pieces = [layout.local(whole, r) for r in range(tp)]
        assert all(abs(p.shape[dim] - pieces[0].shape[dim]) <= len(subs) for p in pieces)
        assert torch.equal(layout.assemble(pieces), whole)
        assert ShardLayout.from_dict(layout.to_dict()) == layout
