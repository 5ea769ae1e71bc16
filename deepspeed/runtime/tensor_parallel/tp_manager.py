# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``TpTrainingManager``: cut a model for tensor-parallel training outside ``deepspeed.initialize``."""

from deepspeed.module_inject.layers import set_autotp_mode
from deepspeed.runtime.tensor_parallel import sharding
from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
from deepspeed.runtime.tensor_parallel.plan import build_plan
from deepspeed.utils import groups


class TpTrainingManager:
    """``TpTrainingManager(model, tp_size, dtype)`` builds the mesh with tensor-parallel groups of ``tp_size``
    (a collective on every rank) and cuts ``model`` in place by its plan (the model's HF ``tp_plan`` or the
    decoder-block heuristic). ``deepspeed.initialize`` with ``tensor_parallel.autotp_size`` does the same and
    more (the gradient reduction of the replicated parameters): prefer it."""

    def __init__(self, model, tp_size, dtype):
        self.module = model
        self.config = TPTrainingConfig(dtype=dtype, autotp_size=int(tp_size))
        set_autotp_mode(training=True)
        plan = build_plan(model, self.config)
        _, _, head_dim = sharding.set_head_counts(model)
        sharding.check_plan(model, plan, int(tp_size), head_dim)
        mesh = groups.initialize_mesh(model_parallel_size=int(tp_size))
        group = mesh.group("model_parallel") if int(tp_size) > 1 else None
        device = next((p.device for p in model.parameters()), None)
        self.layers = sharding.apply_plan(model, plan, group, groups.get_tensor_model_parallel_src_rank(), device)
