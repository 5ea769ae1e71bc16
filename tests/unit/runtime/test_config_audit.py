# SPDX-License-Identifier: Apache-2.0
"""Upstream's config keys that this runtime does not act on: each raises or warns, never passes silently.

``REFUSED`` lists, for every key whose feature is not built, a config fragment that asks for it (the build must
raise ``NotImplementedError`` naming the key) and one that does not (it builds). ``NO_EFFECT`` lists keys that only
tune speed or memory, or that upstream ignores alone: they build with one warning naming the key. Keys this
runtime honours since the audit (``dataloader_drop_last``, ``data_types.param_dtype``, upstream's spelling of
``seq_parallel_communication_data_type``, the ``pipeline`` and ``tensor_parallel`` sections) have their own
tests; NVMe offload and its ``aio`` section build without a warning. On 2 ranks, ``deepspeed.initialize`` with a
refused section raises on both ranks before any collective (the group issued none and stays usable).
"""

import logging

import pytest
import torch

from deepspeed.runtime.configuration import audit as config_audit
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.config_utils import DeepSpeedConfigError
from tests.unit.common import run_distributed

Z = "zero_optimization"

# key -> (asks for the feature, does not ask for it)
REFUSED = {
    "amp": ({"amp": {"enabled": True, "opt_level": "O1"}}, {"amp": {"enabled": False}}),
    "hybrid_engine": ({"hybrid_engine": {"enabled": True}}, {"hybrid_engine": {"enabled": False}}),
    "quantize_training": ({"quantize_training": {"enabled": "true"}}, {"quantize_training": {"enabled": False}}),
    "compression_training": ({"compression_training": {"sparse_pruning": {"shared_parameters": {"enabled": True}}}},
                             {"compression_training": {"sparse_pruning": {"shared_parameters": {"enabled": 0}}}}),
    "weight_quantization": ({"weight_quantization": {"quantized_initialization": {"num_bits": 8}}},
                            {"weight_quantization": {}}),
    "autotuning": ({"autotuning": {"enabled": True}}, {"autotuning": {"enabled": False}}),
    "data_efficiency": ({"data_efficiency": {"enabled": True}}, {"data_efficiency": {"enabled": False}}),
    "curriculum_learning": ({"curriculum_learning": {"enabled": True}}, {"curriculum_learning": {"enabled": False}}),
    "progressive_layer_drop": ({"progressive_layer_drop": {"enabled": True, "theta": 0.5}},
                               {"progressive_layer_drop": {"enabled": False}}),
    "nebula": ({"nebula": {"enabled": True}}, {"nebula": {"enabled": False}}),
    "datastates_ckpt": ({"datastates_ckpt": {"persist": True}}, {"datastates_ckpt": False}),
    "checkpoint.writer.type": ({"checkpoint": {"writer": {"type": "mock"}}},
                               {"checkpoint": {"writer": {"type": "fast"}}}),
    "use_data_before_expert_parallelism": ({"use_data_before_expert_parallelism": True},
                                           {"use_data_before_expert_parallelism": False}),
    "checkpoint.use_node_local_storage": ({"checkpoint": {"use_node_local_storage": True}},
                                          {"checkpoint": {"use_node_local_storage": False}}),
    "sparse_gradients": ({"sparse_gradients": True}, {"sparse_gradients": False}),
    "graph_harvesting": ({"graph_harvesting": True}, {"graph_harvesting": False}),
    "sparse_attention": ({"sparse_attention": {"mode": "fixed"}}, {"sparse_attention": {}}),
}  # yapf: disable

NO_EFFECT = {
    "datastates": {"datastates": {"enabled": True}},
    "dump_state": {"dump_state": True},
}  # yapf: disable


def _build(fragment):
    return DeepSpeedConfig(dict({"train_batch_size": 2}, **fragment), world_size=1)


class _Records(logging.Handler):

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _warnings_of(fragment):
    records = _Records()
    logger = logging.getLogger("DeepSpeed.config")
    logger.addHandler(records)
    try:
        _build(fragment)
    finally:
        logger.removeHandler(records)
    return records.messages


def test_every_row_is_tested():
    assert {row.key for row in config_audit.NOT_BUILT} == set(REFUSED)
    assert {row.key for row in config_audit.NO_EFFECT} == set(NO_EFFECT)


@pytest.mark.parametrize("key", list(REFUSED))
def test_not_built_features_raise(key):
    asks, does_not = REFUSED[key]
    with pytest.raises(NotImplementedError, match=f"config key '{key}'.*not built") as raised:
        _build(asks)
    assert "docs/compatibility.md" in str(raised.value)
    _build(does_not)


@pytest.mark.parametrize("key", list(NO_EFFECT))
def test_no_effect_keys_warn(key):
    messages = _warnings_of(NO_EFFECT[key])
    assert any(f"config key '{key}'" in m and "no effect" in m for m in messages), messages


def test_honoured_keys():
    """Keys the audit found parsed and ignored, now honoured: data_types.param_dtype is checked against the
    precision as upstream asserts it; upstream's spelling of the sequence-parallel communication dtype is read."""
    _build({"data_types": {"param_dtype": "bf16"}, "bf16": {"enabled": True}})
    _build({"data_types": {"param_dtype": "fp32"}})
    for fragment in ({
            "data_types": {
                "param_dtype": "bf16"
            }
    }, {
            "data_types": {
                "param_dtype": "fp16"
            },
            "bf16": {
                "enabled": True
            }
    }):
        with pytest.raises(DeepSpeedConfigError, match="data_types.param_dtype"):
            _build(fragment)
    pipeline = _build({"pipeline": {"stages": 2, "partition": "parameters", "schedule": "zb_h1"}}).pipeline
    assert (pipeline["stages"], pipeline["partition"], pipeline["schedule"]) == (2, "parameters", "zero_bubble")
    nvme_device = {"device": "nvme", "nvme_path": "/x"}
    nvme = {
        Z: {
            "stage": 3,
            "offload_optimizer": nvme_device,
            "offload_param": nvme_device
        },
        "aio": {
            "block_size": 4096
        }
    }
    assert not [m for m in _warnings_of(nvme) if "no effect" in m]  # NVMe offload and its aio section are built
    cfg = _build({"seq_parallel_communication_data_type": "fp32"})
    assert cfg.seq_parallel_communication_data_type == torch.float32
    assert not [m for m in _warnings_of({"seq_parallel_communication_data_type": "fp32"}) if "unknown" in m]


def drop_last_loader_lengths():
    import deepspeed
    out = {}
    for drop_last in (False, True):
        config = {"train_micro_batch_size_per_gpu": 2, "dataloader_drop_last": drop_last}
        engine = deepspeed.initialize(model=torch.nn.Linear(2, 1), config=config)[0]
        loader = engine.deepspeed_io(torch.utils.data.TensorDataset(torch.arange(10.0).reshape(5, 2)))
        out[drop_last] = (len(loader), [len(batch[0]) for batch in loader])
        engine.destroy()
    return out


def test_dataloader_drop_last():
    (out, ) = run_distributed(drop_last_loader_lengths, 1)
    reference = {d: torch.utils.data.DataLoader(range(5), batch_size=2, drop_last=d) for d in (False, True)}
    assert out == {d: (len(r), [len(b) for b in r]) for d, r in reference.items()}


def refused_on_every_rank():
    import deepspeed
    group = torch.distributed.distributed_c10d._get_default_group()
    issued = group._get_sequence_number_for_group()
    config = {"train_micro_batch_size_per_gpu": 1, "hybrid_engine": {"enabled": True}}
    try:
        deepspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    except NotImplementedError as exc:
        raised = str(exc)
    else:
        raised = None
    before_any_collective = group._get_sequence_number_for_group() == issued
    flag = torch.ones(1)
    torch.distributed.all_reduce(flag)  # the group is usable: nobody is waiting in a collective
    return raised, before_any_collective, float(flag)


def test_refused_section_raises_on_every_rank_before_any_collective():
    for raised, before_any_collective, total in run_distributed(refused_on_every_rank, 2):
        assert raised is not None and "'hybrid_engine'" in raised and "hybrid engine" in raised, raised
        assert before_any_collective and total == 2.0
