# SPDX-License-Identifier: Apache-2.0
"""Upstream's ZenFlow device-step optimizers (``deepspeed.ops.adam``), against plain torch AdamW on the columns.

``ZenFlowSelectiveAdamW`` keeps a weight's selected columns in the parameter; ``ZenFlowSelectiveAdamW_stage3`` in
the parameter's ZeRO-3 shard, which holds the weight transposed (``ds_shape`` = (columns, rows)). Both, over
three steps (a snapshot to start from, moments cleared at a new selection, with and without host moments, a shard
on NVMe swapped in and out): the selected columns equal torch's AdamW on those columns alone, everything else is
untouched.
"""

import pytest
import torch

from deepspeed.ops.adam import ZenFlowSelectiveAdamW, ZenFlowSelectiveAdamW_stage3


class Swapper:
    """A shard on "NVMe": a 0-dim placeholder in ``ds_tensor`` while swapped out."""

    def __init__(self, param):
        self.stored, self.ins, self.outs = param.ds_tensor.data.clone(), 0, 0
        param.ds_tensor.data = torch.tensor(0.0)

    def swap_in(self, params, async_op=False):
        self.ins += 1
        params[0].ds_tensor.data = self.stored.clone()

    def swap_out_and_release(self, params, async_op=False):
        self.outs += 1
        self.stored = params[0].ds_tensor.data.clone()
        params[0].ds_tensor.data = torch.tensor(0.0)

    def remove_partition_and_release_buffers(self, params):
        params[0].ds_tensor.data = torch.tensor(0.0)


def weight_of(opt_class, weight, nvme):
    """A parameter holding ``weight`` as that optimizer finds it, and a reader of its current (rows, cols) value."""
    param = torch.nn.Parameter(weight.clone())
    if opt_class is ZenFlowSelectiveAdamW:
        return param, lambda: param.detach().clone()
    rows, cols = weight.shape
    param.ds_shape = (cols, rows)
    param.ds_tensor = weight.t().contiguous().view(-1).clone()
    param.complete_column_offset, param.complete_numel, param.group_id = 0, weight.numel(), 0
    swapper = Swapper(param) if nvme else None

    def value():
        flat = swapper.stored if swapper is not None else param.ds_tensor.data
        return flat.view(cols, rows).t().clone()

    param.nvme_swapper = swapper
    return param, value


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("opt_class,nvme", [(ZenFlowSelectiveAdamW, False), (ZenFlowSelectiveAdamW_stage3, False),
                                            (ZenFlowSelectiveAdamW_stage3, True)])
def test_selected_columns_follow_torch_adamw(opt_class, nvme, offload):
    torch.manual_seed(0)
    start = torch.randn(4, 6)
    param, value = weight_of(opt_class, start, nvme)
    opt = opt_class([param], lr=0.05, weight_decay=0.01, offload=offload)
    cols = torch.tensor([1, 4, 5])
    ref = torch.nn.Parameter(start[:, cols].clone())
    ref_opt = torch.optim.AdamW([ref], lr=0.05, weight_decay=0.01, foreach=False)
    if offload:
        param.exp_avg_cpu_data, param.exp_avg_sq_cpu_data = torch.zeros(4, 3), torch.zeros(4, 3)
    for step in range(3):
        grad = torch.randn(4, 3)
        param.selected_indices = cols
        param.selected_grad = grad if opt_class is ZenFlowSelectiveAdamW else grad.t().contiguous()
        if step == 1:  # a snapshot of the columns is where the update starts (the step overwrote the model)
            opt.temp_copy_param({0: [param]} if opt_class is ZenFlowSelectiveAdamW else [param])
            assert param.temp_selected_param is not None
        if step == 2:
            opt.clear_selected_mv()
            ref_opt.state[ref]["exp_avg"].zero_()
            ref_opt.state[ref]["exp_avg_sq"].zero_()
        if step == 0:
            opt.step()
        else:
            opt.group_step({0: [param]} if opt_class is ZenFlowSelectiveAdamW else [param])
        assert param.selected_grad is None and getattr(param, "temp_selected_param", None) is None
        ref.grad = grad
        ref_opt.step()
        got = value()
        torch.testing.assert_close(got[:, cols], ref.detach(), rtol=1e-6, atol=1e-6)
        others = [c for c in range(6) if c not in cols.tolist()]
        assert torch.equal(got[:, others], start[:, others])
    if nvme:
        assert param.ds_tensor.data.dim() == 0
        assert param.nvme_swapper.ins == 4 and param.nvme_swapper.outs == 3  # one read-only swap-in (the snapshot)
