# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3 parameters: sharding, the ``ds_*`` attributes, ``zero.Init`` and ``GatheredParameters``.

A partitioned parameter keeps only its shard on each rank: the parameter is
flattened, padded to a multiple of the data-parallel world size ``W`` and cut into
``W`` equal shards; rank ``r`` keeps shard ``r`` in ``param.ds_tensor``. While the
parameter is not gathered its ``.data`` is an empty tensor. Attributes (upstream's
names): ``ds_id``, ``ds_numel``, ``ds_shape``, ``ds_status`` (:class:`ZeroParamStatus`),
``ds_tensor``, ``ds_shard_numel``.

A ZeRO-3 engine takes over the shards of a model built inside ``zero.Init`` (or
shards the parameters itself at ``initialize``), and from then on gathers and
releases them through module hooks (``stage3.py``).
"""

import contextlib
import functools
import itertools
import os
import types
from enum import Enum

import torch

from deepspeed.accelerator import get_accelerator  # noqa: F401  (Transformers patches this module global)

_orig_torch_arange = torch.arange  # Transformers reads and patches these module globals
_orig_torch_empty = torch.empty
_next_id = itertools.count()


class ZeroParamStatus:
    # the parameter is gathered: .data holds the full tensor
    AVAILABLE = 1
    # only the shard exists: .data is empty
    NOT_AVAILABLE = 2
    # a gather is in flight
    INFLIGHT = 3


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device=None):
    """Wrap a tensor constructor so floating tensors are created in ``target_fp_dtype`` (on ``target_device``)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if kwargs.get("device", None) is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if tensor.is_floating_point():
            tensor = tensor.to(target_fp_dtype)
        return tensor

    return wrapped


def is_zero_param(param):
    return hasattr(param, "ds_id")


def _dp_world():
    import deepspeed.comm as dist
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _param_world(param):
    """``(world, rank, group)`` a partitioned parameter is sharded over: its own group (an expert parameter of
    expert-parallel size > 1 on ZeRO-3: its expert-data-parallel group) or the data-parallel world."""
    world = getattr(param, "ds_partition_world", None)
    if world is not None:
        return world, param.ds_partition_rank, param.ds_process_group
    world, rank = _dp_world()
    return world, rank, None


def shard_numel(numel, world_size):
    return max(1, -(-numel // world_size))


def _empty_like(param):
    return torch.empty(0, dtype=param.dtype, device=param.device)


@torch.no_grad()
def partition_param(param, world_size=None, rank=None, shard_device=None, dtype=None, group=None, own_group=False):
    """Turn ``param`` into a partitioned parameter, keeping this rank's shard. Idempotent.

    ``own_group``: the parameter is sharded over a group of its own, ``group`` (``world_size`` ranks, this one
    ``rank`` in it; None for a group of one), not the data-parallel world (an expert parameter's
    expert-data-parallel group); gathers and writes of its shard then use that group."""
    if is_zero_param(param):
        return param
    if world_size is None:
        world_size, rank = _dp_world()
    numel = param.numel()
    shard = shard_numel(numel, world_size)
    flat = param.data.reshape(-1)
    if dtype is not None and flat.is_floating_point():
        flat = flat.to(dtype)
    start = rank * shard
    piece = torch.zeros(shard, dtype=flat.dtype, device=shard_device or flat.device)
    take = max(0, min(numel - start, shard))
    if take > 0:
        piece[:take].copy_(flat[start:start + take])
    param.ds_id = next(_next_id)
    param.ds_numel = numel
    param.ds_shape = param.shape
    param.ds_shard_numel = shard
    param.ds_tensor = piece
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    param.ds_persist = False
    if own_group:
        param.ds_process_group = group
        param.ds_partition_world = world_size
        param.ds_partition_rank = rank
    param.ds_active_sub_modules = set()  # upstream's attribute (TRL clears it); the units track use here
    param.data = torch.empty(0, dtype=piece.dtype, device=piece.device)
    # upstream's per-parameter call (the list is its argument, not the parameter); a module function, so a pickled
    # parameter refers to it by name and not back to itself
    param.all_gather_coalesced = all_gather_coalesced
    return param


def all_gather_coalesced(params, safe_mode=False, quantize=False):
    """Make every partitioned parameter of ``params`` whole (a collective: every rank passes the same parameters in
    the same order); ``param.all_gather_coalesced(params)`` as upstream. The gather is complete on return; the
    handle's ``wait()`` is there for upstream's callers. They stay whole until an engine releases them (its forward
    gathers its own units whatever their state); ``GatheredParameters`` is the scoped form."""
    params = [p for p in params if isinstance(p, torch.Tensor) and is_zero_param(p)]
    _shards_current(params)
    for param in params:
        if param.ds_status != ZeroParamStatus.AVAILABLE:
            gather_param(param)
    return MultipleAllGatherHandles([])


@torch.no_grad()
def gather_param(param, group=None):
    """Make a partitioned parameter whole from every rank's shard (a collective)."""
    import deepspeed.comm as dist
    world, _, own = _param_world(param)
    group = own if own is not None else group
    shard = param.ds_tensor
    if hasattr(param, "ds_quant_store"):  # quantized frozen shard (ZeRO++): its dequantized values
        shard = param.ds_quant_store.shard_values(param)
    device = get_accelerator().current_device_name() if shard.device.type == "cpu" and \
        get_accelerator()._name != "cpu" else shard.device
    shard = shard.to(device)
    if world == 1:
        full = shard
    else:
        full = torch.empty(world * shard.numel(), dtype=shard.dtype, device=device)
        dist.all_gather_into_tensor(full, shard.contiguous(), group=group)
    param.data = full[:param.ds_numel].view(param.ds_shape).to(param.dtype, copy=True)
    param.ds_status = ZeroParamStatus.AVAILABLE


@torch.no_grad()
def repartition_param(param, world_size, rank, group, shard_device=None):
    """Re-shard a parameter partitioned over every data-parallel rank (by ``zero.Init``) over a group of its own
    (``world_size`` ranks, this one ``rank`` in it; ``group`` None for a group of one), as ``partition_param`` with
    ``own_group`` would have: its whole value is gathered first (a collective over every rank, which all pass the
    same parameters in the same order). ``ds_id`` and the rest of its attributes are kept."""
    gather_param(param)
    flat = param.data.reshape(-1)
    shard = shard_numel(param.ds_numel, world_size)
    start = rank * shard
    piece = torch.zeros(shard, dtype=param.ds_tensor.dtype, device=shard_device or param.ds_tensor.device)
    take = max(0, min(param.ds_numel - start, shard))
    if take > 0:
        piece[:take].copy_(flat[start:start + take])
    param.ds_shard_numel = shard
    param.ds_tensor = piece
    param.ds_process_group = group
    param.ds_partition_world = world_size
    param.ds_partition_rank = rank
    release_param(param)
    return param


@torch.no_grad()
def write_shard_from_full(param, full):
    """Copy this rank's shard of ``full`` (the whole parameter value) into ``param.ds_tensor``."""
    _, rank, _ = _param_world(param)
    shard = param.ds_shard_numel
    flat = full.reshape(-1)
    start = rank * shard
    take = max(0, min(param.ds_numel - start, shard))
    store = getattr(param, "ds_quant_store", None)
    if store is not None:  # quantized frozen shard (ZeRO++): the new shard is quantized
        values = torch.zeros(shard, dtype=torch.float32, device=param.ds_tensor.device)
        if take > 0:
            values[:take].copy_(flat[start:start + take])
        store.write_shard(param, values)
        return
    param.ds_tensor.zero_()
    if take > 0:
        param.ds_tensor[:take].copy_(flat[start:start + take])


# The shape of a released parameter's ``.data`` (upstream's module global).
partitioned_param_data_shape = [0]


def release_param(param):
    param.data = torch.empty(partitioned_param_data_shape, dtype=param.dtype, device=param.data.device)
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE


class DeepSpeedTensorOverride(Enum):
    """What ``zero.Init`` overrides in tensors created inside it (upstream's names)."""
    dtype = 1
    device = 2


DEFAULT_TENSOR_OVERRIDES = [DeepSpeedTensorOverride.dtype, DeepSpeedTensorOverride.device]


class CUDAQuantizer:
    """Upstream's ZeRO++ weight quantizer (``zero_quantized_weights``, qwZ): not built here; the name imports for code
    that names it and constructing it raises."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("CUDAQuantizer: ZeRO++ quantized weight communication (zero_quantized_weights, "
                                  "qwZ) is not built in this runtime; see docs/compatibility.md")


class ZeroParamType(Enum):
    """How a parameter is held: whole on every rank, partitioned over the data-parallel ranks, or on one rank."""
    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


class MultipleAllGatherHandles:
    """Several in-flight gathers waited on as one: ``wait()`` waits for each handle in order."""

    def __init__(self, handles):
        self.handles = list(handles)

    def wait(self, handle_dependency=True) -> None:
        for handle in self.handles:
            try:
                handle.wait(handle_dependency=handle_dependency)
            except TypeError:  # a torch Work handle takes no such argument
                handle.wait()


class InsertPostInitMethodToModuleSubClasses:
    """A context that calls ``self._post_init_method(module)`` when a module built inside it is complete.

    While the context is active the ``__init__`` of every ``torch.nn.Module`` subclass that defines one (also of
    classes defined inside the context) is wrapped; when the outermost ``__init__`` of a module returns (a
    subclass's ``__init__`` calling its parent's counts once), ``_post_init_method`` runs on it. A module whose
    only ``__init__`` is ``torch.nn.Module``'s own (``Tanh``) has no parameters of its own and is skipped.
    Children are complete before their parent, so they are handed over first. On exit every class is restored.
    ``enabled=False`` makes the context a no-op. ``dtype`` is the dtype parameters are created in:
    ``torch.half``, ``torch.bfloat16`` or ``torch.float`` (None: as built).
    """

    def __init__(self, enabled=True, mem_efficient_linear=True, ds_config=None, dtype=None):
        self.enabled = enabled
        self.mem_efficient_linear = mem_efficient_linear
        self.dtype = dtype
        if dtype is not None and dtype not in (torch.half, torch.bfloat16, torch.float):
            raise ValueError(f"Invalid data type {dtype}, allowed values are [torch.half, torch.bfloat16, "
                             f"torch.float]")
        self._patched = []
        self._orig_init_subclass = None

    def _post_init_method(self, module):
        """Called once per module built inside the context (subclasses implement it)."""

    def __enter__(self):
        if not self.enabled:
            return self
        context = self

        def wrap(cls):
            original = cls.__dict__.get("__init__")
            if original is None or getattr(original, "_ds_init_wrapped", False):
                return

            @functools.wraps(original)
            def init(module, *args, **kwargs):
                depth = getattr(module, "_ds_init_depth", 0)
                object.__setattr__(module, "_ds_init_depth", depth + 1)
                try:
                    original(module, *args, **kwargs)
                finally:
                    object.__setattr__(module, "_ds_init_depth", depth)
                if depth == 0:
                    context._post_init_method(module)

            init._ds_init_wrapped = True
            cls.__init__ = init
            self._patched.append((cls, original))

        def all_subclasses(cls):
            for sub in cls.__subclasses__():
                yield sub
                yield from all_subclasses(sub)

        for cls in set(all_subclasses(torch.nn.Module)):
            wrap(cls)
        self._orig_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

        def init_subclass(cls, **kwargs):
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            wrap(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        for cls, original in reversed(self._patched):
            cls.__init__ = original
        self._patched = []
        if self._orig_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._orig_init_subclass
        return False


def _contradicting_single_rank_pg_error(dp_world_size, explicit_process_group, env=None):
    """The message to raise when ``zero.Init`` would partition over one rank while the launcher started several
    (``WORLD_SIZE`` > 1): a size-1 default group was set up before ``zero.Init`` ran, so every rank would hold the
    whole model. None when the group really shards, when the caller passed a group of its own (a size-1 group is
    then intentional), or when the environment names no multi-process world."""
    if dp_world_size != 1 or explicit_process_group is not None:
        return None
    env = os.environ if env is None else env
    try:
        launched = int(env.get("WORLD_SIZE") or 0)
    except (TypeError, ValueError):
        return None
    if launched <= 1:
        return None
    return (f"zero.Init found a process group of world_size=1 while the launcher reports WORLD_SIZE={launched}: a "
            "single-rank group was set up before zero.Init ran (for example a from_pretrained before "
            "deepspeed.init_distributed()), so the parameters would not be partitioned and every rank would hold "
            "the whole model. Call deepspeed.init_distributed() before building the model under zero.Init, or pass "
            "data_parallel_group explicitly if one rank is intended")


class Init(InsertPostInitMethodToModuleSubClasses):
    """Partition parameters as modules are built, so a model larger than one device can be created.

    Every ``torch.nn.Module`` subclass's ``__init__`` is wrapped while the context is
    active: when a module's ``__init__`` returns, its own parameters are broadcast from
    rank 0 (ranks initialise with different RNG states) and partitioned. Children are
    partitioned when their own ``__init__`` returns: a parent's ``__init__`` initialises its
    children's weights through ``self.apply(fn)`` (each module gathered around ``fn``, rank 0's
    result kept) or inside ``GatheredParameters``; a direct write into a child's parameter
    sees the empty partitioned tensor. ``enabled=False`` makes the context a no-op.
    """

    def __init__(self,
                 module=None,
                 data_parallel_group=None,
                 mem_efficient_linear=True,
                 remote_device=None,
                 pin_memory=False,
                 config_dict_or_path=None,
                 config=None,
                 enabled=True,
                 dtype=None,
                 mpu=None,
                 zero_param_parallel_group=None,
                 zero_quantized_weights=False,
                 zero_quantized_nontrainable_weights=False,
                 sequence_data_parallel_group=None,
                 param_swapper=None):
        super().__init__(enabled=enabled, mem_efficient_linear=mem_efficient_linear, dtype=dtype)
        self.group = data_parallel_group
        if enabled:
            import deepspeed.comm as dist
            if dist.is_initialized():
                explicit = data_parallel_group if data_parallel_group is not None else sequence_data_parallel_group
                error = _contradicting_single_rank_pg_error(dist.get_world_size(data_parallel_group), explicit)
                if error is not None:
                    raise RuntimeError(error)
        self.remote_device = remote_device
        self.pin_memory = pin_memory
        if module is not None and enabled:
            self._partition_module(module)

    def _shard_device(self):
        if self.remote_device in ("cpu", ) or (self.remote_device is None and get_accelerator()._name == "cpu"):
            return torch.device("cpu")
        if self.remote_device == "nvme":
            raise NotImplementedError("zero.Init(remote_device='nvme') is not supported; see docs/compatibility.md")
        return torch.device(get_accelerator().current_device_name())

    def _partition_module(self, module):
        import deepspeed.comm as dist
        device = self._shard_device()
        world, _ = _dp_world()
        for param in module.parameters(recurse=False):
            if is_zero_param(param):
                continue
            if world > 1:  # ranks initialise with their own RNG: shard rank 0's values everywhere
                with torch.no_grad():
                    data = param.data.to(get_accelerator().current_device_name()) \
                        if get_accelerator()._name != "cpu" else param.data
                    dist.broadcast(data, src=0, group=self.group)
                    param.data = data
            partition_param(param, shard_device=device, dtype=self.dtype)

    def _post_init_method(self, module):
        self._partition_module(module)

    # ``module.apply(fn)`` inside the context: a parent's ``__init__`` initialising its children's weights
    # (``self.apply(self._init_weights)``, as HF models do) runs after the children were partitioned. Each module's
    # own partitioned parameters are gathered around ``fn(module)`` and rank 0's result becomes every rank's shards,
    # as ``GatheredParameters(modifier_rank=0)`` does: the same weights whichever rank's RNG ``fn`` drew from.
    def __enter__(self):
        result = super().__enter__()
        if self.enabled:
            self._orig_apply = torch.nn.Module.__dict__["apply"]
            torch.nn.Module.apply = _apply_gathered
        return result

    def __exit__(self, *exc):
        if self.enabled and getattr(self, "_orig_apply", None) is not None:
            torch.nn.Module.apply = self._orig_apply
            self._orig_apply = None
        return super().__exit__(*exc)


def _apply_gathered(module, fn):
    """``torch.nn.Module.apply`` (children first, then the module) with each module's partitioned parameters whole
    while ``fn`` sees it (see ``Init``)."""
    for child in module.children():
        _apply_gathered(child, fn)
    own = [p for p in module.parameters(recurse=False) if is_zero_param(p)]
    if own:
        with GatheredParameters(own, modifier_rank=0):
            fn(module)
    else:
        fn(module)
    return module


class GatheredParameters(contextlib.ContextDecorator):
    """Make partitioned parameters whole inside the context.

    Plain tensors and parameters that are not partitioned are ignored. With
    ``modifier_rank`` (a global rank), that rank's edits are broadcast to every rank that
    holds the parameter and re-partitioned on exit (also into the fp32 masters of an engine
    that owns them). Works before ``deepspeed.initialize``.

    An expert parameter of expert-parallel size > 1 on ZeRO-3 is a different expert on each
    expert-parallel rank, held by its expert-data-parallel group: the edits of one member of
    that group are broadcast over the group (:func:`modifier_source`), and the other groups
    keep their own experts' values edited by their own member.
    """

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if isinstance(p, torch.Tensor) and is_zero_param(p)]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._gathered = []

    def __enter__(self):
        if not self.enabled:
            return self
        _shards_current(self.params)
        for param in self.params:
            if param.ds_status != ZeroParamStatus.AVAILABLE:
                gather_param(param)
                self._gathered.append(param)
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        import deepspeed.comm as dist
        from deepspeed.runtime.backward.ownership import owner_of
        try:
            if self.modifier_rank is not None and exc[0] is None:
                _shards_current(self.params)
                with torch.no_grad():
                    for param in self.params:
                        world, _, group = _param_world(param)
                        if world > 1:
                            dist.broadcast(param.data, src=modifier_source(param, self.modifier_rank), group=group)
                        write_shard_from_full(param, param.data)
                        stage = owner_of(param)
                        if stage is not None:
                            stage.params_modified(param)
        finally:
            for param in self._gathered:
                release_param(param)
            self._gathered = []
        return False


def modifier_source(param, modifier_rank):
    """The global rank whose value of ``param`` a ``GatheredParameters(modifier_rank=...)`` keeps on this rank.

    ``modifier_rank`` itself for a parameter sharded over every data-parallel rank. For one sharded over a group of
    its own (an expert parameter of expert-parallel size > 1 on ZeRO-3: its expert-data-parallel group), the member
    of this rank's group at the position ``modifier_rank`` holds in its own group of that kind: ``modifier_rank``
    where it belongs to this group, else its counterpart (with ``modifier_rank=0``, every group's first rank, the
    rank upstream picks where it reads ``modifier_rank`` as a rank of the parameter's group).
    """
    if getattr(param, "ds_partition_world", None) is None:
        return modifier_rank
    import torch.distributed as tdist
    group = param.ds_process_group
    mine = tuple(tdist.get_process_group_ranks(group)) if group is not None else (tdist.get_rank(), )
    if modifier_rank in mine:
        return modifier_rank
    from deepspeed.utils.groups import current_mesh
    name = getattr(param, "group_name", None)
    kind = f"expert_data_parallel:{name}"
    mesh = current_mesh()
    if name is None or kind not in mesh.groups or tuple(mesh.ranks(kind)) != mine:
        raise ValueError(f"GatheredParameters(modifier_rank={modifier_rank}): rank {modifier_rank} does not hold this "
                         f"parameter (sharded over ranks {list(mine)}) and it belongs to no expert group of the "
                         "mesh to find its counterpart in; pass a rank of that group")
    if not 0 <= modifier_rank < mesh.description.world_size:
        raise ValueError(f"GatheredParameters(modifier_rank={modifier_rank}): no such rank (world size "
                         f"{mesh.description.world_size})")
    theirs = mesh.description.ranks_of(kind, modifier_rank)
    return mine[theirs.index(modifier_rank)]


def _shards_current(params):
    """Before ``ds_tensor`` of ``params`` is read or written directly: an engine's step still writing the shards
    (ZeRO-3 with the offloaded step overlapping the forward) completes."""
    from deepspeed.runtime.backward.ownership import owner_of
    done = set()
    for param in params:
        stage = owner_of(param)
        current = getattr(stage, "shards_current", None)
        if current is not None and id(stage) not in done:
            done.add(id(stage))
            current()


def init_external_params(module):
    """Give ``module`` its ``_external_params`` dict (``id(param) -> param``), upstream's attribute, if it has none,
    and upstream's methods over it: ``module.ds_external_parameters()`` (the dict's items) and
    ``module.all_parameters()`` (its own named parameters, then those)."""
    if hasattr(module, "_external_params"):
        return
    module._external_params = {}
    module.ds_external_parameters = types.MethodType(_external_parameters, module)
    module.all_parameters = types.MethodType(_all_parameters, module)


def _external_parameters(module):
    return module._external_params.items()


def _all_parameters(module):
    return itertools.chain(module.named_parameters(recurse=False), _external_parameters(module))


_init_external_params = init_external_params  # upstream's name


def register_external_parameter(module, parameter):
    """Declare that ``module``'s forward uses ``parameter`` (owned by another module): it is gathered with it.

    Declared before ``deepspeed.initialize``, the parameter is gathered by ``module``'s hooks from the first forward;
    an undeclared one is registered when a forward first reads it (``parameter_offload.ZeROOrderedDict``)."""
    init_external_params(module)
    module._external_params[id(parameter)] = parameter


def unregister_external_parameter(module, parameter):
    getattr(module, "_external_params", {}).pop(id(parameter), None)


# Upstream's zero.Init swaps torch.nn.functional.linear for this; here parameters keep their storage object across
# release and gather, so torch's own linear is safe and nothing is swapped (docs/compatibility.md).
from deepspeed.runtime.zero.linear import zero3_linear_wrap  # noqa: E402,F401
