# SPDX-License-Identifier: Apache-2.0
"""Upstream's top-level names of ``deepspeed`` that this runtime does not build, and why.

``deepspeed.__getattr__`` raises ``AttributeError`` naming the feature for each (so ``hasattr`` is False and
``from deepspeed import X`` fails with the reason); every other name of upstream 0.19.8's ``dir(deepspeed)``
(:data:`deepspeed.runtime.engine_parts.names.TOP_LEVEL`) is an attribute of the package.
"""

NOT_BUILT = {
    "DeepSpeedHybridEngine": "the hybrid engine (RLHF generation inside DeepSpeed)",
    "DualPipeVEngine": "the DualPipeV pipeline schedule",
    "DualPipeVModule": "the DualPipeV pipeline schedule",
    "InferenceEngine": "DeepSpeed inference",
    "DeepSpeedInferenceConfig": "DeepSpeed inference",
    "inference": "DeepSpeed inference",
    "model_implementations": "DeepSpeed inference's model implementations",
    "replace_transformer_layer": "kernel injection (inference)",
    "DeepSpeedTransformerLayer": "the fused transformer layer op",
    "DeepSpeedTransformerConfig": "the fused transformer layer op",
    "autotuning": "the autotuner",
    "compile": "DeepCompile's graph passes ('compile.deepcompile' runs engine.compile(): torch.compile with the "
    "engine's hooks eager)",
    "datastates": "DataStates checkpointing",
    "io": "deepspeed.io (the fast checkpoint file writers)",
    "git_version_info_installed": "the install-time version record (setup.py writes it into an installed package "
    "only; deepspeed.git_version_info reads it when present)",
    "linear": "deepspeed.linear (OptimizedLinear, quantized LoRA)",
    "resolve_per_head_muon_after_sharding": "per-head Muon",
    "set_optimizer_flags": "per-head Muon",
}


def not_built(name):
    """The AttributeError for ``deepspeed.<name>``, or None when the name is not one of :data:`NOT_BUILT`."""
    if name not in NOT_BUILT:
        return None
    return AttributeError(f"deepspeed.{name} is not part of this runtime: {NOT_BUILT[name]} is not built; see "
                          f"docs/compatibility.md")
