# SPDX-License-Identifier: Apache-2.0
"""A checkpoint file holds its tensors' bytes: not the flat buffers they are views of, a tied weight once; and it
loads bitwise.

``torch.save`` writes the whole storage of every tensor; ZeRO's parameters are views of one flat buffer. The
reference is plain torch: the size ``torch.save`` gives to compact copies of the same tensors (ties kept tied), and
the tensors' values at the save.
"""

import io
import os
from collections import OrderedDict, namedtuple

import pytest
import torch

from tests.unit.checkpoint import test_checkpoint_resume as common
from tests.unit.common import run_distributed

Pair = namedtuple("Pair", "first second")


def _saved_size(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return len(buffer.getvalue())


def compact_reference(obj, memo=None):
    """Plain torch: ``obj`` with every tensor a compact copy, one copy per distinct view (a tie stays one tensor)."""
    memo = {} if memo is None else memo
    if torch.is_tensor(obj):
        key = (obj.untyped_storage().data_ptr(), obj.dtype, obj.storage_offset(), tuple(obj.shape), obj.stride())
        if key not in memo:
            memo[key] = obj.detach().clone()
        return memo[key]
    if isinstance(obj, dict):
        return type(obj)((k, compact_reference(v, memo)) for k, v in obj.items())
    if isinstance(obj, list):
        return [compact_reference(v, memo) for v in obj]
    if isinstance(obj, tuple):
        values = [compact_reference(v, memo) for v in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    return obj


def _tensors(obj, out):
    if torch.is_tensor(obj):
        out.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors(value, out)
    return out


def _same(a, b):
    if torch.is_tensor(a):
        return (torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                and torch.equal(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _random_payload(gen):
    """Views of two flat buffers (odd and 1-wide shapes, a transposed view, an expanded one, an empty one, a tie),
    a tensor that owns its storage, and a buffer whose views cover it whole."""
    flat = torch.randn(int(torch.randint(5000, 9000, (1, ), generator=gen)), generator=gen).to(torch.bfloat16)
    offset, views = 0, []
    for _ in range(6):
        rows, cols = (int(v) for v in torch.randint(1, 17, (2, ), generator=gen))
        views.append(flat[offset:offset + rows * cols].view(rows, cols))
        offset += rows * cols + int(torch.randint(0, 9, (1, ), generator=gen))
    ints = torch.arange(4000, dtype=torch.int64)
    whole = torch.randn(60, generator=gen)
    state = OrderedDict((f"w{i}", v) for i, v in enumerate(views))
    state["tied"] = views[2]  # a second name for one tensor
    state["transposed"] = views[3].t()
    state["expanded"] = flat[offset:offset + 3].view(3, 1).expand(3, 5)
    state["empty"] = flat[offset + 3:offset + 3]
    state["conjugate"] = torch.randn(40, dtype=torch.complex64, generator=gen)[3:9].conj()  # a lazy flag: as it is
    return dict(module=state,
                parts=[ints[7:20], ints[100:101], Pair(ints[300:340].view(5, 8), 3)],
                own=torch.randn(33, generator=gen),
                whole=(whole[:30], whole[30:]),
                step=7), flat, whole


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_views_are_written_as_their_own_bytes_without_copies(seed):
    from deepspeed.runtime.checkpoint_engine.compaction import compact_views
    payload, flat, whole = _random_payload(torch.Generator().manual_seed(seed))
    reference = compact_reference(payload)
    compacted = compact_views(payload)

    # nothing copied: every tensor still reads the memory it read
    for before, after in zip(_tensors(payload, []), _tensors(compacted, [])):
        assert before.data_ptr() == after.data_ptr() and _same(before, after)
    assert compacted["whole"] is payload["whole"]  # views covering their buffer whole: left as they are
    assert compacted["own"] is payload["own"]
    assert compacted["module"]["tied"] is compacted["module"]["w2"]

    size, expected = _saved_size(compacted), _saved_size(reference)
    assert size <= expected + 1024, (size, expected)
    assert _saved_size(payload) > size + flat.nbytes // 2  # what torch.save alone writes: the flat buffers

    loaded = torch.load(io.BytesIO(_bytes(compacted)), weights_only=False)
    assert _same(loaded, payload)
    assert loaded["module"]["tied"].data_ptr() == loaded["module"]["w2"].data_ptr()  # loads tied
    assert loaded["whole"][1].data_ptr() - loaded["whole"][0].data_ptr() == 30 * 4  # still one storage
    del whole


def _bytes(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def bytes_worker(tmp, stage, dtype, dim):
    """Every file this rank wrote is no bigger than plain torch's compact copies of its own tensors; the module
    entry holds the module's state dict bitwise, its tie loads tied; a fresh engine loads the save bitwise."""
    rank = torch.distributed.get_rank()
    common.attach_checkpointing()
    cfg = common.make_config(stage, dtype)
    engine = common.build_engine(cfg, seed=3, tie=True, frozen=True, dim=dim)
    common.train(engine, 2, 0, rank)
    expected = common.snapshot(engine)
    state = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    engine.save_checkpoint(tmp, tag="t")
    engine.destroy()
    sizes = {}
    for name in sorted(os.listdir(os.path.join(tmp, "t"))):
        if name.startswith(".") or (rank != 0 and f"rank_{rank}_" not in name):
            continue
        path = os.path.join(tmp, "t", name)
        loaded = torch.load(path, map_location="cpu", weights_only=False)
        size, reference = os.path.getsize(path), _saved_size(compact_reference(loaded))
        assert size <= reference + 1024, f"{name}: {size} bytes, compact copies {reference}"
        sizes[name] = size
        module = loaded.get("module") if "model_states" in name else None
        if module and stage < 3:
            assert list(module) == list(state) and all(torch.equal(module[k], state[k]) for k in state)
            tied = [k for k in module if k in ("emb.weight", "head.weight")]
            assert len(tied) == 2 and module[tied[0]].data_ptr() == module[tied[1]].data_ptr(), tied
    resumed = common.build_engine(cfg, seed=4, tie=True, frozen=True, dim=dim)
    resumed.load_checkpoint(tmp, tag="t")
    bad = common.differences(expected, common.snapshot(resumed))
    resumed.destroy()
    assert not bad, bad
    return sizes


CELLS = [(1, "bf16", None), (2, "fp32", 7), (3, "bf16", 5), (0, "bf16", None)]


@pytest.mark.parametrize("stage,dtype,dim", CELLS, ids=[f"z{s}-{d}-dim{m}" for s, d, m in CELLS])
def test_checkpoint_files_hold_tensor_bytes_and_load_bitwise(tmp_path, stage, dtype, dim):
    sizes = run_distributed(bytes_worker, 2, args=(str(tmp_path), stage, dtype, dim), timeout=120)
    assert "mp_rank_00_model_states.pt" in sizes[0] or stage == 3, sizes
    assert all(sizes) or stage == 0, sizes  # stages 1-3: every rank wrote its files
