# SPDX-License-Identifier: Apache-2.0
"""The engine's tensor parallelism: from the config to a cut model whose replicated parameters are marked.

``deepspeed.initialize`` calls, in order:

1. :meth:`TensorParallelTraining.configure` on every rank before any collective: the section
   (``tensor_parallel``, merged with what ``tp_model_init`` recorded), the size, the group
   source (the mesh, an ``mpu`` or ``tp_model_init``'s ``tp_group``) and the sharding plan with
   every cut checked (``sharding.check_plan``); a bad value raises the same error everywhere;
2. :meth:`shard` once the mesh exists (its model axis is the tensor-parallel group): the plan
   is applied (``sharding.apply_plan``);
3. :meth:`classify` once the model is on its device: each replicated trainable parameter gets
   its kind (``replicated.py``) from one traced forward of the cut model, or from the rules
   when its inputs cannot be made up (then the first real forward is traced and checked), and
   the first-forward check of the inputs is installed (``data_check.py``).

The gradient reduction reads the kinds (``engine_parts.mesh.reduction_plan``); a model whose
tensor-parallel layers come from an ``mpu`` (Megatron-style, no ``autotp_size``) keeps its
layers: its parameters without ``tensor_model_parallel`` are taken as replicated ``"mean"``.
"""

import torch

import deepspeed.comm as dist
from deepspeed.module_inject.layers import configure_tensor_parallel_runtime, set_autotp_mode
from deepspeed.runtime.engine_parts import mesh as engine_mesh
from deepspeed.runtime.tensor_parallel import init_utils, replicated, sharding
from deepspeed.runtime.tensor_parallel.data_check import FirstForwardCheck
from deepspeed.runtime.tensor_parallel.plan import build_plan
from deepspeed.utils import groups
from deepspeed.utils.logging import log_dist


def _group_ranks(group):
    return tuple(sorted(torch.distributed.get_process_group_ranks(group)))


class TensorParallelTraining:
    """The engine's tensor parallelism (module docstring)."""

    def __init__(self, config, size, plan, tp_group=None):
        self.config = config
        self.size = size
        self.plan = plan  # None: the model is tensor parallel already (an mpu's layers)
        self.tp_group = tp_group
        self.group = None
        self.layers = {}
        self.check = None
        self.traced = False

    # ---------------------------------------------------------------- 1. before any collective
    @classmethod
    def configure(cls, ds_config, model, mpu, world_size):
        """The engine's tensor parallelism, or None without it (module docstring, step 1)."""
        tp_config = ds_config.tensor_parallel_config
        mpu_size = engine_mesh.mpu_model_parallel_size(mpu)
        recorded = init_utils.recorded_args() or {}
        tp_group = recorded.get("tp_group")
        if tp_config.autotp_size >= 1 or recorded:
            set_autotp_mode(training=True)
        size = tp_config.tp_size
        if size <= 1 and mpu_size <= 1:
            return None
        if size > 1 and world_size % size != 0:
            raise ValueError(f"tensor_parallel.autotp_size ({size}) must divide the world size ({world_size})")
        if size > 1 and mpu_size not in (1, size):
            raise ValueError(f"tensor_parallel.autotp_size ({size}) differs from the mpu's model-parallel size "
                             f"({mpu_size})")
        if tp_group is not None and mpu is not None:
            raise ValueError("tp_model_init provided tp_group; deepspeed.initialize must not receive mpu.")
        if tp_config.tensor_parallel.tp_group is not None and mpu is not None:
            raise ValueError("tensor_parallel.tp.tp_group and an mpu both give tensor-parallel groups; pass one")
        tp_group = tp_group if tp_group is not None else tp_config.tensor_parallel.tp_group
        zero = ds_config.zero_config
        stage = ds_config.zero_optimization_stage
        offload = [
            str(getattr(d, "value", d)) for d in (zero.offload_optimizer_device if stage > 0 else "none",
                                                  zero.offload_param_device if stage == 3 else "none")
        ]
        if any(d not in ("none", "None") for d in offload) or zero.zenflow is not None:
            raise NotImplementedError("tensor parallelism (AutoTP) with offload_optimizer, offload_param or ZenFlow "
                                      "is not supported; see docs/tensor_parallel.md")
        configure_tensor_parallel_runtime(tp_config)
        if size <= 1:  # an mpu's tensor parallelism: the model's layers are its own
            return cls(tp_config, mpu_size, None)
        if getattr(model, "ds_autotp_parsed", False):
            raise ValueError("AutoTP: this model was already cut by an earlier engine; build a fresh model")
        from deepspeed.module_inject import tp_shard
        tp_shard.set_tp_grain_size(tp_config.tensor_parallel.tp_grain_size)
        plan = build_plan(model, tp_config)
        _, _, head_dim = sharding.set_head_counts(model)
        sharding.check_plan(model, plan, size, head_dim)
        return cls(tp_config, size, plan, tp_group)

    # ------------------------------------------------------------------------------ 2. the cut
    def shard(self, model, mesh, device):
        """Apply the plan over the mesh's tensor-parallel group (a collective; module docstring, step 2)."""
        self.group = mesh.group("model_parallel") if mesh.description.model_parallel_size > 1 else None
        if self.tp_group is not None:
            given = _group_ranks(self.tp_group)
            if given != tuple(mesh.ranks("model_parallel")):
                raise ValueError(f"tp_model_init's tp_group {list(given)} is not this rank's tensor-parallel group of "
                                 f"the mesh {list(mesh.ranks('model_parallel'))} (tensor-parallel ranks are adjacent)")
        if self.plan is None:
            return
        src = groups.get_tensor_model_parallel_src_rank()
        self.layers = sharding.apply_plan(model, self.plan, self.group, src, _comm_device(device))

    # ------------------------------------------------------------------ 3. the replicated kinds
    def classify(self, module, device):
        """Mark every replicated trainable parameter "sum" or "mean" and install the first-forward check."""
        if self.plan is None:
            replicated.apply_kinds(module, {}, default=replicated.MEAN)
            return
        declared = {name: replicated.SUM for name in self.plan.grad_sum}
        inputs = replicated.probe_inputs(module)
        kinds = None
        if inputs is not None:
            try:
                kinds = replicated.trace_kinds(module, inputs)
            except Exception as err:  # the same model and inputs on every rank: every rank gets here together
                log_dist(
                    f"AutoTP: could not trace the model at initialize ({type(err).__name__}: {err}); the "
                    f"first forward is traced instead",
                    ranks=[0])
                kinds = None
        ok = torch.tensor([0.0 if kinds is None else 1.0], device=_comm_device(device))
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        self.traced = ok.item() > 0
        if self.traced:
            for name, kind in declared.items():
                if kinds.get(name, kind) != kind:
                    log_dist(
                        f"AutoTP: {name} is declared summed over the group (grad_allreduce) but acts on replicated "
                        f"activations only; its gradient is reduced as the data flow says",
                        ranks=[0])
            replicated.apply_kinds(module, kinds)
        else:
            replicated.apply_kinds(module, declared)
        sums = sorted(n for n, p in module.named_parameters() if replicated.kind_of(p) == replicated.SUM)
        if sums:
            log_dist(
                f"AutoTP: {len(sums)} replicated parameters act on sharded activations and have their gradient "
                f"summed over the tensor-parallel group, e.g. {sums[0]!r}",
                ranks=[0])
        src = groups.get_tensor_model_parallel_src_rank()
        self.check = FirstForwardCheck(module, self.group, src, _comm_device(device), trace=not self.traced)

    def release(self):
        if self.check is not None:
            self.check.remove()
            self.check = None


def _comm_device(device):
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device) if device is not None else torch.device("cpu")
