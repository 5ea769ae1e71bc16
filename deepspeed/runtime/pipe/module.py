# SPDX-License-Identifier: Apache-2.0
"""``PipelineModule``: a model given as a list of layers, cut into pipeline stages, each rank building its own.

The layers are ``LayerSpec`` (built only on the rank that owns the layer), ``TiedLayerSpec`` (one module per
``key`` on every rank that uses it, its ``tied_weight_attr`` parameters shared by all uses), ``nn.Module``
instances or plain callables. The cut is ``self.parts``: ``num_stages + 1`` layer boundaries from the
partition method (``uniform``, ``parameters``, ``type:<regex>``), stage ``s`` owning layers
``parts[s]:parts[s + 1]``. A rank builds only its stage's layers and registers them under their global
layer index (``"3.weight"``), so parameter names, like the per-layer checkpoint files, do not depend on the
cut; tied modules live under ``tied_modules.<key>``.

Interleaved schedules cut the layers into ``num_stages * chunks`` parts: rank ``r`` owns parts
``r, r + num_stages, ...`` (its *chunks*), run one at a time (:meth:`set_active_chunk`).

The stages are the pipe axis of the run's mesh (:class:`~deepspeed.runtime.pipe.topology.PipelineParallelGrid`);
the module creates no process group of its own (tied weights use ``groups.group_of_ranks``). Every check of
the arguments raises on every rank before the grid's first collective.
"""

import glob
import os
import re
from functools import partial

import torch
from torch import nn

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime import utils as ds_utils
from deepspeed.runtime.activation_checkpointing import checkpointing
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid
from deepspeed.utils import groups, logger


class PipelineError(Exception):
    """Errors related to the use of ``deepspeed.pipe.PipelineModule``."""


class LayerSpec:
    """The specification of one pipeline layer: ``typename(*module_args, **module_kwargs)``, built later.

    Only the rank that owns the layer builds it, so a large model is never whole in one process.
    """

    def __init__(self, typename, *module_args, **module_kwargs):
        if not issubclass(typename, nn.Module):
            raise RuntimeError("LayerSpec only supports torch.nn.Module types.")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs
        self.global_rank = dist.get_rank() if dist.is_initialized() else -1

    def __repr__(self):
        return ds_utils.call_to_str(self.typename.__name__, *self.module_args, **self.module_kwargs)

    def build(self, log=False):
        """Construct the module."""
        if log:
            logger.info(f"RANK={self.global_rank} building {repr(self)}")
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A :class:`LayerSpec` whose ``tied_weight_attr`` parameters are shared by every layer with ``key``.

    ``forward_fn(module, inputs)``, when given, is called instead of ``module(inputs)`` (an embedding reused
    as the output head). ``tied_weight_attr`` names parameters of the module, dotted paths allowed.
    """

    def __init__(self, key, typename, *module_args, forward_fn=None, tied_weight_attr=["weight"], **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def _layer_name(layer):
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return layer.__class__.__name__
    return getattr(layer, "__name__", None)


class PipelineModule(nn.Module):
    """A model given as a sequence of layers, split into pipeline stages (see the module docstring).

    ``num_stages`` or ``topology`` must be given; with ``num_stages`` alone the topology is
    ``PipeDataParallelTopology(num_stages, world // num_stages)``. ``loss_fn(outputs, labels)`` is
    computed on the last stage. ``activation_checkpoint_interval=k`` runs blocks of ``k`` layers under
    ``activation_checkpoint_func``; ``dynamic_shape`` lets activations change shape between
    micro-batches (otherwise a change is an error).
    """

    def __init__(self,
                 layers,
                 num_stages=None,
                 topology=None,
                 loss_fn=None,
                 seed_layers=False,
                 seed_fn=None,
                 base_seed=1234,
                 partition_method="parameters",
                 activation_checkpoint_interval=0,
                 activation_checkpoint_func=checkpointing.checkpoint,
                 checkpointable_layers=None,
                 dynamic_shape=False):
        super().__init__()
        # Every check before the grid's collective, from inputs every rank has alike.
        if num_stages is None and topology is None:
            raise RuntimeError("must provide num_stages or topology")
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise AssertionError("param `checkpointable_layers` must be type of list.")
        if int(activation_checkpoint_interval) < 0:
            raise ValueError(f"activation_checkpoint_interval must be >= 0, got {activation_checkpoint_interval}")
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        local = os.environ.get("LOCAL_RANK")
        self.local_rank = int(local) if local is not None else (dist.get_local_rank() if dist.is_initialized() else 0)
        if topology is not None:
            self._topo = topology
            self.num_stages = self._topo.get_dim("pipe")
            if num_stages is not None and num_stages != self.num_stages:
                raise ValueError(f"num_stages ({num_stages}) differs from the topology's pipe dimension "
                                 f"({self.num_stages})")
        else:
            if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
                raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
            self.num_stages = num_stages
            if self.world_size % num_stages != 0:
                raise RuntimeError(f"num_stages ({num_stages}) must divide distributed world size "
                                   f"({self.world_size})")
            self._topo = PipeDataParallelTopology(num_pp=num_stages, num_dp=self.world_size // num_stages)
        if self._topo.world_size() != self.world_size:
            raise RuntimeError(f"the topology {self._topo} has {self._topo.world_size()} ranks, but the world has "
                               f"{self.world_size}")
        self.num_stages = max(self.num_stages, 1)
        if self._num_layers < self.num_stages:
            raise ValueError(f"PipelineModule: {self._num_layers} layers cannot be cut into {self.num_stages} "
                             f"pipeline stages; give at least one layer per stage")

        self.micro_offset = 0
        self.loss_fn = loss_fn
        self.checkpointable_layers = checkpointable_layers
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.activation_checkpoint_func = activation_checkpoint_func
        self.dynamic_shape = dynamic_shape
        self.checkpoint_parallel_write_pipeline = False
        self._partition_method = partition_method

        # The grid: this topology's mesh (a collective on every rank).
        self._grid = PipelineParallelGrid(topology=self._topo)
        self.stage_id = self._topo.get_coord(self.global_rank).pipe if "pipe" in self._topo.get_axis_names() else 0

        self._chunks = 1
        self._active_chunk = 0
        self._local_start = 0
        self._local_stop = None
        self._partition_layers(method=partition_method)
        self._build_local()

    # ------------------------------------------------------------------ partitioning
    def _count_layer_params(self):
        """The number of trainable parameters of each layer (builds one ``LayerSpec`` at a time)."""
        counts = [0] * len(self._layer_specs)
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, LayerSpec):
                layer = layer.build()
            if isinstance(layer, nn.Module):
                counts[idx] = sum(p.numel() for p in layer.parameters() if p.requires_grad)
        return counts

    def _find_layer_type(self, layername):
        """The indices of the layers whose class name matches ``layername`` (a case-insensitive regex)."""
        pattern = re.compile(layername, re.IGNORECASE)
        idxs = [
            idx for idx, layer in enumerate(self._layer_specs)
            if (name := _layer_name(layer)) is not None and pattern.search(name)
        ]
        if not idxs:
            raise RuntimeError(f"Partitioning '{layername}' found no valid layers to partition.")
        return idxs

    def _partition_weights(self, method):
        method = method.lower()
        if method == "uniform":
            return None
        if method == "parameters":
            return self._count_layer_params()
        if method.startswith("type:"):
            weights = [0] * len(self._layer_specs)
            for idx in self._find_layer_type(method.split(":", 1)[1]):
                weights[idx] = 1
            return weights
        raise NotImplementedError(f"Partitioning method {method} not implemented.")

    def _partition_layers(self, method="uniform"):
        """Set ``self.parts`` (the layer boundaries of every part) and this rank's bounds (:meth:`_set_bounds`)."""
        parts_count = self.num_stages * self._chunks
        weights = self._partition_weights(method)
        if weights is None:
            self.parts = ds_utils.partition_uniform(num_items=self._num_layers, num_parts=parts_count)
        else:
            self.parts = ds_utils.partition_balanced(weights=weights, num_parts=parts_count)
        if self.global_rank == 0:
            logger.info(f"Partitioning pipeline stages with method {method}: parts {self.parts}")
        stage = self._topo.get_coord(self.global_rank).pipe if "pipe" in self._topo.get_axis_names() else 0
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def _set_bounds(self, start=None, stop=None):
        """Build layers ``[start, stop)`` on this rank (a slice: None means from the start, or to the end)."""
        self._local_start = start
        self._local_stop = stop

    def _chunk_ranges(self):
        """``[(start, stop)]`` of the layers of each of this rank's chunks, in chunk order."""
        if self._chunks == 1:
            start = self._local_start or 0
            stop = self._num_layers if self._local_stop is None else self._local_stop
            return [(start, stop)]
        stage = self.stage_id
        return [(self.parts[c * self.num_stages + stage], self.parts[c * self.num_stages + stage + 1])
                for c in range(self._chunks)]

    def partitions(self):
        return self.parts

    def stage_owner(self, layer_idx):
        """The pipeline stage (rank on the pipe axis) that owns layer ``layer_idx``."""
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer {layer_idx} out of range [0, {self._num_layers})")
        for part in range(len(self.parts) - 1):
            if self.parts[part] <= layer_idx < self.parts[part + 1]:
                return part % self.num_stages
        raise RuntimeError(f"Layer {layer_idx} not owned? parts={self.parts}")

    # ------------------------------------------------------------------ building
    def _build_local(self):
        self.forward_funcs = []
        self.fwd_map = {}
        self._chunk_funcs = []
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs = {}
        for start, stop in self._chunk_ranges():
            self._chunk_funcs.append(self._build(start, stop))
        self.forward_funcs = [f for funcs in self._chunk_funcs for f in funcs]
        position = 0
        for start, stop in self._chunk_ranges():
            for layer_idx in range(start, stop):
                if str(layer_idx) in self._modules:
                    self.fwd_map[str(layer_idx)] = position
                position += 1
        for p in self.parameters():
            p.ds_pipe_replicated = False
        self._checkpointable = {}
        self.to(get_accelerator().device_name(self.local_rank))
        self.tied_comms = self._index_tied_modules()
        self._synchronize_tied_weights()

    def _build(self, start=None, stop=None):
        """Build layers ``[start, stop)`` (default: this rank's bounds); returns their forward functions."""
        start = self._local_start if start is None else start
        stop = self._local_stop if stop is None else stop
        funcs = []
        for layer_idx in range(start or 0, self._num_layers if stop is None else stop):
            layer = self._layer_specs[layer_idx]
            if self.seed_layers:
                if self.seed_fn:
                    self.seed_fn(self.base_seed + layer_idx)
                else:
                    ds_utils.set_random_seed(self.base_seed + layer_idx)
            if isinstance(layer, PipelineModule):
                raise NotImplementedError("RECURSIVE BUILD NOT YET IMPLEMENTED")
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
            elif isinstance(layer, (nn.Module, LayerSpec)):
                module = layer.build() if isinstance(layer, LayerSpec) else layer
                name = str(layer_idx)
                self.add_module(name, module)
                funcs.append(module)
            else:
                funcs.append(layer)
        return funcs

    # ------------------------------------------------------------------ tied weights
    @staticmethod
    def _recursive_getattr(module, attr_name):
        """``module.a.b`` for ``attr_name='a.b'``."""
        for item in attr_name.split("."):
            module = getattr(module, item)
        return module

    def _index_tied_modules(self):
        """For every tie key: the ranks (one per owning stage, same data/model coordinate) and their group.

        Every rank creates the same groups in the same order; a tied copy on any rank but the first of its
        group is marked ``ds_pipe_replicated`` so that it is counted once in gradient norms.
        """
        comms = {}
        if self.num_stages == 1:
            return comms
        keys = sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)})
        grid = self._grid
        for key in keys:
            owners = sorted({
                self.stage_owner(i)
                for i, s in enumerate(self._layer_specs) if isinstance(s, TiedLayerSpec) and s.key == key
            })
            table = []
            for dp in range(grid.data_parallel_size):
                for mp in range(grid.get_slice_parallel_world_size()):
                    extra = {"data": dp} if "data" in self._topo.get_axis_names() else {}
                    if "model" in self._topo.get_axis_names():
                        extra["model"] = mp
                    table.append([grid.stage_to_global(stage_id=s, **extra) for s in owners])
            group = groups.group_of_ranks(table)
            mine = next((ranks for ranks in table if self.global_rank in ranks), None)
            if mine is None:
                continue
            if key not in self.tied_modules:
                raise PipelineError(f"rank {self.global_rank} is in the tie group of '{key}' but built no module "
                                    f"for it")
            comms[key] = {
                "ranks": mine,
                "group": group,
                "weight_attr": self.tied_weight_attrs[key],
                "module": self.tied_modules[key],
            }
            if self.global_rank != mine[0]:
                for p in self.tied_modules[key].parameters():
                    p.ds_pipe_replicated = True
        return comms

    def _tied_weights(self):
        """``[(key, parameter, comm)]`` of every tied weight this rank holds, in a fixed order."""
        out = []
        for key, comm in self.tied_comms.items():
            for attr in comm["weight_attr"]:
                out.append((key, self._recursive_getattr(self.tied_modules[key], attr), comm))
        return out

    def allreduce_tied_weight_gradients(self):
        """All-reduce the ``.grad`` of every tied weight over the stages that hold it."""
        for _, weight, comm in self._tied_weights():
            if weight.grad is not None and len(comm["ranks"]) > 1:
                dist.all_reduce(weight.grad, group=comm["group"])

    def get_tied_weights_and_groups(self):
        return [(weight, comm["group"]) for _, weight, comm in self._tied_weights()]

    @torch.no_grad()
    def _synchronize_tied_weights(self):
        for _, weight, comm in self._tied_weights():
            if len(comm["ranks"]) > 1:
                dist.broadcast(weight.data, src=min(comm["ranks"]), group=comm["group"])

    # ------------------------------------------------------------------ forward
    def set_active_chunk(self, chunk):
        """Which of this rank's chunks :meth:`forward` runs (interleaved schedules; 0 otherwise)."""
        if not 0 <= chunk < self._chunks:
            raise ValueError(f"chunk {chunk} out of range: this rank holds {self._chunks}")
        self._active_chunk = chunk

    def _set_chunks(self, chunks):
        """Re-cut the layers into ``num_stages * chunks`` parts and rebuild this rank's (before any training).

        Every ``LayerSpec`` layer of the new cut is built afresh (tied weights are broadcast again).
        """
        if chunks == self._chunks:
            return
        if chunks > 1 and self._num_layers < self.num_stages * chunks:
            raise ValueError(f"{self._num_layers} layers cannot be cut into {self.num_stages} stages x {chunks} "
                             f"chunks; give at least one layer per chunk")
        for name in list(self._modules):
            if name != "tied_modules":
                del self._modules[name]
        self._chunks = int(chunks)
        self._active_chunk = 0
        self._partition_layers(method=self._partition_method)
        self._build_local()

    def _exec_range_func(self, funcs, offset):

        local_micro_offset = self.micro_offset + 1

        def exec_func(*inputs):
            if len(inputs) == 1:
                inputs = inputs[0]
            for idx, layer in enumerate(funcs):
                self.curr_layer = idx + offset
                if self.seed_layers:
                    new_seed = (self.base_seed * local_micro_offset) + self.curr_layer
                    if self.seed_fn:
                        self.seed_fn(new_seed)
                    else:
                        ds_utils.set_random_seed(new_seed)
                inputs = layer(inputs)
            return inputs

        return exec_func

    def forward(self, forward_input):
        """Run this rank's (active chunk's) layers: ``x = layer(x)``, a tuple passed as one argument."""
        self.micro_offset += 1
        chunk = self._active_chunk
        funcs = self._chunk_funcs[chunk]
        offset = self._chunk_ranges()[chunk][0]
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return self._exec_range_func(funcs, offset)(forward_input)
        x = forward_input
        checkpointable = self._checkpointable_blocks(chunk, funcs, interval)
        for block, start in enumerate(range(0, len(funcs), interval)):
            run = self._exec_range_func(funcs[start:start + interval], offset + start)
            if not isinstance(x, tuple):
                x = (x, )
            x = self.activation_checkpoint_func(run, *x) if checkpointable[block] else run(*x)
        return x

    def _checkpointable_blocks(self, chunk, funcs, interval):
        """Per block of ``interval`` layers, whether it runs checkpointed (cached per chunk and interval)."""
        key = (chunk, interval, self.activation_checkpoint_func)
        if key not in self._checkpointable:
            self._checkpointable[key] = [
                self._is_checkpointable(funcs[s:s + interval]) for s in range(0, len(funcs), interval)
            ]
        return self._checkpointable[key]

    def _precompute_checkpointable_values(self):
        self._checkpointable = {}

    @property
    def is_checkpointable_results(self):
        """Per block of ``activation_checkpoint_interval`` layers of the active chunk, whether ``forward`` runs it
        checkpointed, for the current interval ([] when it is 0)."""
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return []
        chunk = self._active_chunk
        return list(self._checkpointable_blocks(chunk, self._chunk_funcs[chunk], interval))

    def _is_checkpointable(self, funcs):
        if self.activation_checkpoint_func is not checkpointing.non_reentrant_checkpoint:
            # A reentrant checkpoint needs an input that requires grad; upstream keys GPT models by class name.
            if self.__class__.__name__ in ("GPTModelPipe", "GPT2ModelPipe"):
                return all("ParallelTransformerLayerPipe" in f.__class__.__name__ or (
                    self.checkpointable_layers is not None and f.__class__.__name__ in self.checkpointable_layers)
                           for f in funcs)
        if self.checkpointable_layers is not None:
            return all(f.__class__.__name__ in self.checkpointable_layers for f in funcs)
        return any(len(list(f.parameters())) > 0 for f in funcs if isinstance(f, nn.Module))

    def set_checkpoint_interval(self, interval):
        if interval < 0:
            raise ValueError(f"checkpoint interval must be >= 0, got {interval}")
        self.activation_checkpoint_interval = int(interval)
        self._precompute_checkpointable_values()

    # ------------------------------------------------------------------ queries
    def topology(self):
        """The ProcessTopology object to query process mappings."""
        return self._topo

    def mpu(self):
        return self._grid

    def num_pipeline_stages(self):
        return self._topo.get_dim("pipe")

    def get_additional_losses(self):
        """Model-specific losses to report, ``{name: value}``, or None."""
        return None

    def compile(self, *args, **kwargs):
        """``torch.compile`` each layer (modules in place, callables replaced by their compiled form)."""
        for funcs in self._chunk_funcs:
            for idx, layer in enumerate(funcs):
                if isinstance(layer, nn.Module):
                    layer.compile(*args, **kwargs)
                else:
                    funcs[idx] = torch.compile(layer, *args, **kwargs)
        self.forward_funcs = [f for funcs in self._chunk_funcs for f in funcs]

    def _mesh_description(self):
        """The mesh this module's stages live on (what the engine builds its groups from)."""
        return self._grid._mesh.description

    # ------------------------------------------------------------------ checkpoints
    def ckpt_prefix(self, checkpoints_path, tag):
        """``<path>/<tag>/module-pipe_XX[-model_YY]``: a prefix naming this rank's files (data axis omitted)."""
        rank_name = "module"
        coord = self._topo.get_coord(self.global_rank)
        for axis in self._topo.get_axis_names():
            if axis != "data":
                rank_name += f"-{axis}_{getattr(coord, axis):02d}"
        return os.path.join(checkpoints_path, str(tag), rank_name)

    def _layer_index(self, local_layer_idx):
        index = 0
        for start, stop in self._chunk_ranges():
            if local_layer_idx < index + (stop - start):
                return start + local_layer_idx - index
            index += stop - start
        raise IndexError(f"local layer {local_layer_idx} out of range")

    def ckpt_layer_path(self, ckpt_dir, local_layer_idx):
        """``layer_XX[-model_YY]-model_states.pt`` of this rank's ``local_layer_idx``-th layer."""
        idx = self._layer_index(local_layer_idx)
        path = os.path.join(ckpt_dir, f"layer_{idx:02d}")
        rank_repr = self._topo.get_rank_repr(rank=self.global_rank)
        if rank_repr:
            path += f"-{rank_repr}"
        return path + "-model_states.pt"

    def ckpt_layer_path_list(self, ckpt_dir, local_layer_idx):
        """Every file saved for this rank's ``local_layer_idx``-th layer (any model-parallel rank), sorted."""
        idx = self._layer_index(local_layer_idx)
        return sorted(glob.glob(os.path.join(ckpt_dir, f"layer_{idx:02d}-*model_states.pt")))

    def _frozen_names(self, layer):
        return [n for n, p in layer.named_parameters() if not p.requires_grad]

    def _layers_to_save(self):
        """``[(local index, layer)]`` this rank writes: all of its layers on data-parallel rank 0, or its share
        with ``checkpoint.parallel_write.pipeline_stage``."""
        count = len(self.forward_funcs)
        dp_rank, dp_size = self._grid.data_parallel_id, self._grid.data_parallel_size
        if self.checkpoint_parallel_write_pipeline:
            bounds = ds_utils.partition_uniform(count, dp_size)
            start, stop = bounds[dp_rank], bounds[dp_rank + 1]
        elif dp_rank != 0:
            return []
        else:
            start, stop = 0, count
        return [(i, self.forward_funcs[i]) for i in range(start, stop)]

    def layer_state_dicts(self, exclude_frozen_params=False):
        """``[(file path relative to the tag directory, state dict)]`` of the layers this rank writes."""
        out = []
        for idx, layer in self._layers_to_save():
            if not hasattr(layer, "state_dict"):
                continue
            state = layer.state_dict()
            if exclude_frozen_params:
                for name in self._frozen_names(layer):
                    state.pop(name, None)
            out.append((os.path.basename(self.ckpt_layer_path("", idx)), state))
        return out

    def save_state_dict(self, save_dir, checkpoint_engine=None, exclude_frozen_params=False):
        """Write this rank's layer files into ``save_dir`` (``checkpoint_engine.save`` when given)."""
        from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
        os.makedirs(save_dir, exist_ok=True)
        for name, state in self.layer_state_dicts(exclude_frozen_params):
            state = clone_tensors_for_torch_save(state)
            path = os.path.join(save_dir, name)
            if checkpoint_engine is not None:
                checkpoint_engine.save(state, path)
            else:
                torch.save(state, path)

    def load_state_dir(self, load_dir, checkpoint_engine=None, strict=True):
        """Load every layer of this rank from its file in ``load_dir``, then re-broadcast the tied weights."""
        for idx, layer in enumerate(self.forward_funcs):
            if not hasattr(layer, "load_state_dict"):
                continue
            files = self.ckpt_layer_path_list(load_dir, idx)
            if not files:
                raise FileNotFoundError(f"no checkpoint file for layer {self._layer_index(idx)} in {load_dir}")
            rank_repr = self._topo.get_rank_repr(rank=self.global_rank)
            mine = [f for f in files if rank_repr and f"-{rank_repr}-" in os.path.basename(f)]
            path = (mine or files)[0]
            if checkpoint_engine is not None:
                state = checkpoint_engine.load(path, map_location="cpu")
            else:
                state = torch.load(path, map_location="cpu", weights_only=False)
            layer.load_state_dict(state, strict=strict)
        self._synchronize_tied_weights()
