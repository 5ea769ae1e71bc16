# SPDX-License-Identifier: Apache-2.0
"""The tensor-parallel layers on their own, against ``nn.Linear`` in plain torch, and what the first forward checks.

``layer_checks``: column (sharded and gathered output, an uneven 129-wide output), row, fused ``[q; k; v]`` of
unequal parts and ``[gate; up]``, each with and without ``tp_overlap_comm``: the outputs, this rank's piece of the
weight and bias gradients and the input's gradient equal ``nn.Linear``'s on the same input;
``GatherReplacedLayerParams`` makes the parameters whole and cuts them back.

``data_checks``: tensor-parallel ranks given different inputs fail the first forward with upstream's message on every
rank; the same inputs pass.
"""

import copy

import torch
from torch import nn


def _linear(n_in, n_out, seed):
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out)


def _cut_last(tensor, layout, rank):
    """This rank's piece of the last dimension of an activation, cut like the output rows of ``layout``'s weight."""
    from deepspeed.module_inject.layers import ShardLayout
    n = tensor.shape[-1]
    rows = ShardLayout((n, tensor.numel() // n), 0, layout.sub_sizes, layout.widths)
    return rows.local(tensor.reshape(-1, n).t().contiguous(), rank).t().reshape(*tensor.shape[:-1], -1)


def _check(bad, what, got, want, atol=1e-5):
    if tuple(got.shape) != tuple(want.shape) or not torch.allclose(got, want, atol=atol, rtol=1e-5):
        bad.append(f"{what}: max |diff| {float((got - want).abs().max()) if got.shape == want.shape else 'shape'}")


def layer_checks():
    import deepspeed.comm as dist
    from deepspeed.module_inject.layers import (GatherReplacedLayerParams, LinearAllreduce, LinearLayer,
                                                SubParamLinearLayer, TensorParallel_Layer, fused_LinearLayer)
    from deepspeed.module_inject import tp_shard
    from deepspeed.module_inject.tp_shard import get_shard_size_list
    group = torch.distributed.group.WORLD  # tensor-parallel size = world size
    tp, rank = dist.get_world_size(), dist.get_rank()
    tp_shard.set_num_kv_heads(None)  # even cuts: no head counts from an earlier model
    bad = []
    for overlap in (False, True):
        TensorParallel_Layer.tp_overlap_comm = overlap
        for kind, n_in, n_out, extra in (("column", 16, 12, {}), ("column", 16, 129, {
                "gather_output": True
        }), ("row", 18, 7, {}), ("qkv", 8, 8 + 4 + 4, {
                "shape": ((8, 4, 4), -1)
        }), ("gate_up", 8, 2 * 6, {})):
            torch.manual_seed(7)
            x = torch.randn(2, 3, n_in)
            dense = _linear(n_in, n_out, 3)
            x_ref = x.clone().requires_grad_(True)
            out_ref = dense(x_ref)
            (out_ref * torch.arange(out_ref.numel()).view_as(out_ref).sin()).sum().backward()
            module = copy.deepcopy(dense)
            if kind == "row":
                layer = LinearAllreduce(module, group)
                widths = get_shard_size_list(n_in, tp, "row")
                start = sum(widths[:rank])
                x_in = x[..., start:start + widths[rank]].clone().requires_grad_(True)
            else:
                if kind == "qkv":
                    layer = SubParamLinearLayer(module, group, name="self_attn.qkv_proj", **extra)
                elif kind == "gate_up":
                    layer = fused_LinearLayer(module, group, shape=(2, -1), name="mlp.gate_up_proj")
                else:
                    layer = LinearLayer(module, group, name="lm_head", **extra)
                x_in = x.clone().requires_grad_(True)
            out = layer(x_in)
            layout = layer.weight.ds_tp_layout
            sharded_out = kind != "row" and not extra.get("gather_output")
            want_out = _cut_last(out_ref.detach(), layout, rank) if sharded_out else out_ref.detach()
            _check(bad, f"{kind} overlap={overlap}: output", out.detach(), want_out)
            weights = torch.arange(out_ref.numel()).view_as(out_ref).sin()
            if sharded_out:
                weights = _cut_last(weights, layout, rank)
            (out * weights).sum().backward()
            _check(bad, f"{kind} overlap={overlap}: weight grad", layer.weight.grad,
                   layout.local(dense.weight.grad, rank))
            if kind == "row":
                _check(bad, f"{kind}: bias grad", layer.bias.grad, dense.bias.grad)
                _check(bad, f"{kind}: input grad", x_in.grad, x_ref.grad[..., start:start + widths[rank]])
            else:
                _check(bad, f"{kind}: bias grad", layer.bias.grad,
                       layer.bias.ds_tp_layout.local(dense.bias.grad, rank))
                _check(bad, f"{kind}: input grad", x_in.grad, x_ref.grad)
            with GatherReplacedLayerParams([layer.weight, layer.bias], layer):
                _check(bad, f"{kind}: gathered weight", layer.weight.detach(), dense.weight.detach())
            _check(bad, f"{kind}: cut back", layer.weight.detach(), layout.local(dense.weight.detach(), rank))
    TensorParallel_Layer.tp_overlap_comm = False
    return bad


class _Tiny(nn.Module):

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).square().mean()


def data_checks():
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import groups
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "tensor_parallel": {
            "autotp_size": 2,
            "partition_config": {
                "use_default_specs":
                False,
                "layer_specs": [{
                    "patterns": [r".*up\.weight$"],
                    "partition_type": "column"
                }, {
                    "patterns": [r".*down\.weight$"],
                    "partition_type": "row"
                }]
            }
        }
    }
    out = []
    for same in (False, True):
        engine, _, _, _ = deepspeed.initialize(model=_Tiny(), config=config)
        x = torch.ones(1, 4) * (1.0 if same else float(dist.get_rank() + 1))
        try:
            engine.backward(engine(x))
            out.append("passed")
        except AssertionError as err:
            out.append(str(err))
        engine.destroy()
        groups.reset_mesh()
    return out


def _qwen3_config(**tp):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "zero_optimization": {
            "stage": 1
        },
        "tensor_parallel": dict({"autotp_size": 2}, **tp)
    }


_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                "all_gather_object", "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                "all_to_all_single", "gather", "scatter", "barrier", "monitored_barrier", "send", "recv", "isend",
                "irecv", "new_group")


class _CountCollectives:
    """Counts the calls of torch.distributed's collectives (group creation included: it synchronises the ranks too)
    while active; every wrapper still calls the real function, so a case that does communicate is only counted."""

    def __enter__(self):
        import torch.distributed as tdist
        self.calls, self._saved = [], {}
        for name in _COLLECTIVES:
            real = getattr(tdist, name, None)
            if real is None:
                continue
            self._saved[name] = real

            def wrapper(*args, _real=real, _name=name, **kwargs):
                self.calls.append(_name)
                return _real(*args, **kwargs)

            setattr(tdist, name, wrapper)
        return self

    def __exit__(self, *exc):
        import torch.distributed as tdist
        for name, real in self._saved.items():
            setattr(tdist, name, real)


def _one_kv_head_qwen3():
    """A Qwen3 with one key/value head: at tensor-parallel size 2 a rank would hold no head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    return Qwen3ForCausalLM(
        Qwen3Config(vocab_size=33,
                    hidden_size=16,
                    intermediate_size=32,
                    num_hidden_layers=1,
                    num_attention_heads=4,
                    num_key_value_heads=1,
                    head_dim=4,
                    max_position_embeddings=32,
                    attn_implementation="eager"))


def bad_inputs():
    """Each bad input raises on every rank before any collective:
    ``[(case, type name, start of the message, collectives called before the error)]``."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.tensor_parallel import init_utils
    from deepspeed.utils import groups
    from tests.unit.tensor_parallel import reference as ref
    world = dist.get_world_size()
    cases = {
        "size not dividing the world":
        lambda: deepspeed.initialize(model=ref.build("qwen3"), config=_qwen3_config(autotp_size=world + 1)),
        "more ranks than key/value heads":
        lambda: deepspeed.initialize(model=_one_kv_head_qwen3(), config=_qwen3_config(autotp_size=2)),
        "unknown key":
        lambda: deepspeed.initialize(model=ref.build("qwen3"), config=_qwen3_config(tp_sise=2)),
        "inference kernels":
        lambda: deepspeed.initialize(model=ref.build("qwen3"), config=_qwen3_config(kernel_inject=True)),
        "bad partition type":
        lambda: deepspeed.initialize(
            model=ref.build("qwen3"),
            config=_qwen3_config(partition_config={"layer_specs": [{
                "patterns": ["x"],
                "partition_type": "diagonal"
            }]})),
        "an embedding asked to be cut":
        lambda: deepspeed.initialize(model=ref.build("qwen3"),
                                     config=_qwen3_config(
                                         partition_config={
                                             "layer_specs": [{
                                                 "patterns": [r".*embed_tokens\.weight$"],
                                                 "partition_type": "column"
                                             }]
                                         })),
        "offload":
        lambda: deepspeed.initialize(model=ref.build("qwen3"),
                                     config=dict(_qwen3_config(),
                                                 zero_optimization={
                                                     "stage": 2,
                                                     "offload_optimizer": {
                                                         "device": "cpu"
                                                     }
                                                 })),
    }

    def tp_model_init_then(config, **init_kwargs):
        init_utils.reset()
        model = deepspeed.tp_model_init(ref.build("qwen3"), tp_size=2, dtype=torch.float16, **init_kwargs)
        return deepspeed.initialize(model=model, config=config, mpu=init_kwargs.pop("mpu", None))

    def tp_group_with_mpu():
        init_utils.record_tp_model_init_args(2, torch.float16, torch.distributed.group.WORLD, dist)
        init_utils.merge_tp_model_init_into_config({}, object(), None, dist)

    cases["tp_model_init size differs"] = lambda: tp_model_init_then(_qwen3_config(autotp_size=1))
    cases["tp_model_init dtype differs"] = lambda: tp_model_init_then(dict(_qwen3_config(), bf16={"enabled": True}))
    cases["tp_group with mpu"] = tp_group_with_mpu
    with _CountCollectives() as counted:  # the counter sees what deepspeed.comm calls
        dist.barrier()
    out = [("the counter", "counted", "", counted.calls)]
    for name, case in cases.items():
        groups.reset_mesh()
        with _CountCollectives() as counted:
            try:
                case()
                out.append((name, "no error", "", counted.calls))
            except Exception as err:
                out.append((name, type(err).__name__, str(err)[:48], list(counted.calls)))
            finally:
                init_utils.reset()
        groups.reset_mesh()
    return out


class _TokenMLP(nn.Module):
    """Token-wise (no attention), so sequence parallelism needs no exchange: embedding, a norm, an MLP block cut
    over the tensor-parallel ranks, a final norm and a gathered head."""

    def __init__(self, vocab=23, hidden=6, inner=10):
        super().__init__()
        torch.manual_seed(4)
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)
        self.final_norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)
        with torch.no_grad():
            for p in (self.norm.weight, self.norm.bias, self.final_norm.weight, self.final_norm.bias):
                p.add_(0.3 * torch.randn_like(p))

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))
        return self.head(self.final_norm(h))


def with_sequence_parallel(stage):
    """Tensor x sequence parallelism (tp 2, sp 2 at world 4), every axis of the mesh at once: one SGD step of each
    rank's shard of the sequence, the group's loss (``sequence_parallel_loss``) backpropagated, equals plain torch
    on the whole sequence."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_parallel_loss
    from deepspeed.utils import groups
    model = _TokenMLP()
    reference = copy.deepcopy(model).double()
    config = dict(_qwen3_config(
        partition_config={
            "use_default_specs":
            False,
            "layer_specs": [{
                "patterns": [r"up\.weight$"],
                "partition_type": "column"
            }, {
                "patterns": [r"down\.weight$"],
                "partition_type": "row"
            }, {
                "patterns": [r"head\.weight$"],
                "partition_type": "column",
                "gather_output": True
            }]
        }),
                  sequence_parallel_size=2,
                  gradient_clipping=0.0)
    config["zero_optimization"] = {"stage": stage}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    seq = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 23, (1, 7), generator=seq)
    labels = torch.randint(0, 23, (1, 7), generator=seq)
    sp, sp_rank = groups._get_sequence_parallel_world_size(), groups._get_sequence_parallel_rank()
    cut = [0, 4, 7][sp_rank:sp_rank + 2]  # uneven shards: 4 and 3 tokens
    logits = engine(ids[:, cut[0]:cut[1]])
    shard_loss = torch.nn.functional.cross_entropy(logits.view(-1, 23), labels[:, cut[0]:cut[1]].reshape(-1))
    loss = sequence_parallel_loss(shard_loss, torch.tensor(cut[1] - cut[0]), groups._get_sequence_parallel_group())
    engine.backward(loss)
    engine.step()
    state = engine._consolidated_16bit_state_dict()
    ref_loss = torch.nn.functional.cross_entropy(reference(ids).view(-1, 23), labels.view(-1))
    ref_loss.backward()
    bad = [] if sp == 2 else [f"sequence-parallel size {sp}"]
    if abs(float(loss) - float(ref_loss)) > 1e-5:
        bad.append(f"loss {float(loss)} != {float(ref_loss)}")
    if state is not None:
        for name, p in reference.named_parameters():
            want = (p - 0.1 * p.grad).float()
            if not torch.allclose(state[name], want, atol=1e-5, rtol=1e-5):
                bad.append(f"{name}: max |diff| {float((state[name] - want).abs().max()):.3g}")
    engine.destroy()
    groups.reset_mesh()
    return bad
