# SPDX-License-Identifier: Apache-2.0
"""``clone_tensors_for_torch_save``: compact, detached copies, containers kept, nothing shared."""

import collections
import io

import torch

from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer

Pair = collections.namedtuple("Pair", "first second")


def _saved_bytes(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getbuffer().nbytes


def test_views_are_saved_at_their_own_size():
    flat = torch.arange(100_000, dtype=torch.float32)
    view = flat[10:20]
    clone = clone_tensors_for_torch_save(view)
    torch.testing.assert_close(clone, view)
    assert clone.untyped_storage().nbytes() == view.numel() * view.element_size()
    assert _saved_bytes(clone) < _saved_bytes(view) / 100


def test_containers_are_walked_and_nothing_is_shared():
    param = torch.nn.Parameter(torch.randn(3, 2))
    strided = torch.arange(12.0).view(3, 4)[:, ::2]
    state = collections.OrderedDict(weight=param,
                                    nested={
                                        "items": [strided, 5, "name"],
                                        "pair": Pair(param[0], None)
                                    },
                                    step=3)
    state_with_default = collections.defaultdict(list, {"a": param})
    cloned = clone_tensors_for_torch_save(state)

    assert type(cloned) is collections.OrderedDict and list(cloned) == list(state)
    assert type(cloned["nested"]["pair"]) is Pair
    assert cloned["step"] == 3 and cloned["nested"]["items"][1:] == [5, "name"]
    for original, copy in [(param, cloned["weight"]), (strided, cloned["nested"]["items"][0]),
                           (param[0], cloned["nested"]["pair"].first)]:
        torch.testing.assert_close(copy, original.detach())
        assert not copy.requires_grad and type(copy) is torch.Tensor
        assert copy.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
    cloned["weight"].add_(1.0)
    assert not torch.equal(cloned["weight"], param.detach())

    cloned_default = clone_tensors_for_torch_save(state_with_default)
    assert cloned_default.default_factory is list and cloned_default["missing"] == []


def test_optimizer_markers():
    assert issubclass(ZeROOptimizer, DeepSpeedOptimizer)
    assert not issubclass(DeepSpeedOptimizer, ZeROOptimizer)
    assert not isinstance(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), DeepSpeedOptimizer)
