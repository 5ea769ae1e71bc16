# SPDX-License-Identifier: Apache-2.0
"""Every config key upstream DeepSpeed 0.19.8 reads is honoured, refused by name, or listed here as having no
effect by design with its reason; none is silently ignored.

The keys come from ``upstream_schema/upstream_config_keys.json``, generated from upstream's own config classes by
``upstream_schema/list_config_keys.py`` (run with upstream's interpreter). Each key falls in one class, decided in
this order; the test checks each class's promise on ``DeepSpeedConfig`` (what ``initialize`` builds on every rank
before any collective):

* ``REFUSED``: setting the key to the value given here raises an error that names the key.
* ``UNDER_REFUSED``: keys of a section whose switch is refused (they act only when it is on); the switch's
  refusal is checked.
* ``NO_EFFECT``: accepted by design without effect, with the reason (docs/compatibility.md says the same).
* ``FREE_FORM``: values that are objects or user data passed through (no type to check), with the reason.
* otherwise *honoured*: the parser reads and validates the key: a value of the wrong type raises an error naming it
  (a key nobody reads could not). What each honoured key does is tested where its feature is.
"""

import json
import logging
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
KEYS_FILE = os.path.join(HERE, "upstream_schema", "upstream_config_keys.json")
WRONG_TYPE = [["not a value of any key's type"]]

# key -> a value that asks for the feature
REFUSED = {
    "amp": {
        "enabled": True
    },
    "nebula": {
        "enabled": True
    },
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True
            }
        }
    },
    "quantize_training": {
        "enabled": True
    },
    "hybrid_engine.enabled": True,
    "autotuning.enabled": True,
    "data_efficiency.enabled": True,
    "curriculum_learning": {
        "enabled": True
    },
    "progressive_layer_drop": {
        "enabled": True
    },
    "weight_quantization.quantized_initialization": {
        "num_bits": 8
    },
    "weight_quantization.post_init_quant": {
        "fc": {
            "num_bits": 8
        }
    },
    "use_data_before_expert_parallelism": True,
    "checkpoint.use_node_local_storage": True,
    "checkpoint.writer.type": "mock",
    "datastates_ckpt": {},
    "zero_optimization.mics_shard_size": 2,
    "zero_optimization.mics_hierarchical_params_gather": True,
}

# section prefix -> the refused key whose switch its keys depend on
UNDER_REFUSED = {
    "hybrid_engine": "hybrid_engine.enabled",
    "autotuning": "autotuning.enabled",
    "data_efficiency": "data_efficiency.enabled",
    "weight_quantization": "weight_quantization.quantized_initialization",
}

NO_EFFECT = {
    "sparse_gradients":
    "embedding gradients are reduced dense, to the same values (upstream 0.19.8 refuses the key)",
    "graph_harvesting":
    "a speed option of upstream's CUDA graphs (upstream 0.19.8 refuses the key)",
    "sparse_attention":
    "configures sparse attention ops, which are not part of this runtime (upstream 0.19.8 "
    "refuses the section)",
    "eigenvalue":
    "upstream 0.19.8 refuses the section; here it configures the eigenvalue monitor (docs/monitor.md)",
    "elasticity":
    "upstream 0.19.8 refuses the section; batch sizes are set directly",
    "dump_state":
    "the engine's state is not printed (DeepSpeedConfig.print() shows the configuration)",
    "vocabulary_size":
    "upstream only logs whether it is a multiple of 8 (tensor-core alignment)",
    "prescale_gradients":
    "the 1/W of the mean is folded into each contribution's fp32 factor: pre-division "
    "changes no result",
    "gradient_predivide_factor":
    "the 1/W of the mean is folded into each contribution's fp32 factor",
    "timers.throughput.enabled":
    "the progress line's samples/s come from the host clock",
    "timers.throughput.synchronized":
    "the throughput timer never synchronises the device",
    "timers":
    "the throughput timer's section (its keys have no effect, above)",
    "timers.throughput":
    "the throughput timer's section (its keys have no effect, above)",
    "zero_optimization.allgather_partitions":
    "updated parameters are all-gathered per reduce bucket or unit",
    "zero_optimization.allgather_bucket_size":
    "updated parameters are all-gathered per reduce bucket or unit",
    "zero_optimization.contiguous_gradients":
    "gradients are always contiguous",
    "zero_optimization.round_robin_gradients":
    "the partitioning of gradients is fixed by the layout",
    "zero_optimization.sub_group_size":
    "a speed knob of upstream's optimizer step (NVMe offload's page size here)",
    "zero_optimization.stage3_max_live_parameters":
    "one unit is prefetched ahead",
    "zero_optimization.max_live_parameters":
    "one unit is prefetched ahead",
    "zero_optimization.stage3_max_reuse_distance":
    "one unit is prefetched ahead",
    "zero_optimization.max_reuse_distance":
    "one unit is prefetched ahead",
    "zero_optimization.stage3_model_persistence_threshold":
    "a speed knob: which parameters stay gathered",
    "zero_optimization.model_persistence_threshold":
    "a speed knob: which parameters stay gathered",
    "zero_optimization.stage3_module_granularity_threshold":
    "a speed knob of upstream's fetch grouping",
    "zero_optimization.module_granularity_threshold":
    "a speed knob of upstream's fetch grouping",
    "zero_optimization.stage3_use_all_reduce_for_fetch_params":
    "a speed knob of upstream's fetch collective",
    "zero_optimization.use_all_reduce_for_fetch_params":
    "a speed knob of upstream's fetch collective",
    "zero_optimization.leaf_module":
    "units are whole modules already",
    "zero_optimization.leaf_module.classes":
    "units are whole modules already",
    "zero_optimization.leaf_module.names":
    "units are whole modules already",
    "zero_optimization.leaf_module.name_suffixes":
    "units are whole modules already",
    "zero_optimization.load_from_fp32_weights":
    "the fp32 masters always come from the checkpoint's fp32 values",
    "zero_optimization.elastic_checkpoint":
    "checkpoints load on any world size (upstream deprecated the key)",
    "zero_optimization.use_multi_rank_bucket_allreduce":
    "a speed knob of upstream's bucketing",
    "zero_optimization.memory_efficient_linear":
    "linear layers keep autograd's own saved tensors",
    "zero_optimization.compute_grad_norm":
    "the norm is always computed (engine.get_global_grad_norm())",
    "zero_optimization.offload_optimizer.pipeline_read":
    "NVMe steps are always pipelined",
    "zero_optimization.offload_optimizer.pipeline_write":
    "NVMe steps are always pipelined",
    "zero_optimization.offload_optimizer.fast_init":
    "NVMe state is initialised by the pipelined step",
    "aio.single_submit":
    "the I/O threads submit one block at a time",
    "aio.overlap_events":
    "completions are always overlapped",
    "checkpoint.writer.data_parallel":
    "upstream splits a replicated file's bytes across data-parallel writers "
    "through a torch.save hook (save_torch_storage_object_list) that stock torch never calls; here every rank "
    "writes its own partition files in parallel and the replicated model states once",
    "checkpoint.writer.io_multiplier":
    "multiplies data_parallel's writers (see checkpoint.writer.data_parallel)",
    "checkpoint.writer.io_buffer_double":
    "files are written through one buffered file (io_buffer_size); the "
    "double-buffered async_io path measured no faster (docs/checkpoints.md)",
}

FREE_FORM = {
    "tensor_parallel.tp.mpu": "a model-parallel unit object, passed through",
    "tensor_parallel.tp.tp_group": "a process group object, passed through",
    "tensor_parallel.tensor_parallel.mpu": "a model-parallel unit object, passed through",
    "tensor_parallel.tensor_parallel.tp_group": "a process group object, passed through",
}


def _rows():
    with open(KEYS_FILE) as handle:
        data = json.load(handle)
    assert data["deepspeed_version"] == "0.19.8", data["deepspeed_version"]
    return [row["key"] for row in data["keys"]]


KEYS = _rows()


def _under(key, prefix):
    return key == prefix or key.startswith(prefix + ".")


def classify(key):
    if key in REFUSED:
        return "refused", REFUSED[key]
    for prefix, switch in UNDER_REFUSED.items():
        if _under(key, prefix):
            return "under_refused", switch
    if key in NO_EFFECT:
        return "no_effect", NO_EFFECT[key]
    if key in FREE_FORM:
        return "free_form", FREE_FORM[key]
    return "honoured", None


def _config(key, value):
    cfg = {"train_micro_batch_size_per_gpu": 1}
    node = cfg
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return cfg


def _build(cfg):
    from deepspeed.runtime.config import DeepSpeedConfig
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        return DeepSpeedConfig(cfg)
    finally:
        logging.disable(previous)


def _raises_naming(cfg, key):
    with pytest.raises(Exception) as caught:
        _build(cfg)
    assert not isinstance(caught.value, (AttributeError, TypeError, KeyError)), \
        f"{key}: an accident, not a check: {type(caught.value).__name__}: {caught.value}"
    assert key.split(".")[-1] in str(caught.value), f"{key}: the error does not name it: {caught.value}"


def test_the_list_is_upstreams_whole_schema():
    """The generated list holds the keys of every kind of upstream section (a sanity check of the generator)."""
    for key in ("train_batch_size", "zero_optimization.offload_optimizer.nvme_path", "bf16.enabled",
                "checkpoint.writer.decoupled", "checkpoint.writer.io_buffer_size", "aio.block_size",
                "activation_checkpointing.cpu_checkpointing", "disable_python_gc", "tensorboard.output_path",
                "zero_optimization.mics_shard_size", "flops_profiler.profile_step"):
        assert key in KEYS, key
    assert len(KEYS) > 300 and len(set(KEYS)) == len(KEYS)


def test_every_table_entry_is_an_upstream_key():
    stale = [k for table in (REFUSED, NO_EFFECT, FREE_FORM) for k in table if k not in KEYS]
    stale += [p for table in (UNDER_REFUSED, ) for p in table if not any(_under(k, p) for k in KEYS)]
    assert not stale, stale
    assert all(reason.strip() for table in (NO_EFFECT, FREE_FORM) for reason in table.values())


@pytest.mark.parametrize("key", [k for k in KEYS if classify(k)[0] == "refused"])
def test_refused_key_raises_naming_it(key):
    _raises_naming(_config(key, REFUSED[key]), key)


@pytest.mark.parametrize("prefix,switch", sorted(UNDER_REFUSED.items()))
def test_keys_under_a_refused_switch(prefix, switch):
    _raises_naming(_config(switch, REFUSED[switch]), switch)


def test_honoured_keys_are_read_and_validated():
    """A wrong-typed value of every honoured key raises an error naming it: the parser reads each one."""
    ignored = []
    for key in KEYS:
        if classify(key)[0] != "honoured":
            continue
        try:
            _build(_config(key, WRONG_TYPE))
        except Exception as exc:
            if key.split(".")[-1] not in str(exc) or isinstance(exc, (AttributeError, TypeError, KeyError)):
                ignored.append(f"{key}: raised without naming it: {type(exc).__name__}: {exc}")
            continue
        ignored.append(f"{key}: a wrong-typed value was accepted (nobody reads the key)")
    assert not ignored, "\n".join(ignored)


def test_no_effect_keys_are_the_audited_ones():
    """Keys the config audit warns about are no-effect keys here: the two lists agree."""
    from deepspeed.runtime.configuration import audit as config_audit
    audited = {row.key for row in config_audit.NO_EFFECT if row.key in KEYS}
    assert all(classify(key)[0] == "no_effect" for key in audited), \
        {key: classify(key) for key in audited}
