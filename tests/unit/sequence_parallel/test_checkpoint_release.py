# SPDX-License-Identifier: Apache-2.0
"""checkpoint_offloaded frees its restored input and recomputed output before the inner backward, unless the
recomputed graph saved them: gradients equal plain autograd's for functions whose ends are saved, aliased or
modified in place, and the memory of the ends that are not saved is released."""

import pytest
import torch

from deepspeed.runtime.sequence_parallel.activation_offload import checkpoint_offloaded


def _linear_tail(w):
    return lambda x: torch.tanh(x @ w) + x  # add: neither the output nor x is saved by its last node


def _exp_tail(w):
    return lambda x: torch.exp((x @ w) * 0.1)  # exp saves its own output


def _mul_input(w):
    return lambda x: x * w.sum()  # mul saves x


def _identity_out(w):
    return lambda x: (x, (x @ w).sum(-1))  # an output that is the input itself


def _inplace_tail(w):

    def fn(x):
        h = x @ w
        h += 1.0  # an in-place result: left alone
        return h.sigmoid() * h

    return fn


def _tuple_with_plain(w):
    return lambda x: (torch.relu(x @ w), 3)  # a plain value among the outputs


CASES = [_linear_tail, _exp_tail, _mul_input, _identity_out, _inplace_tail, _tuple_with_plain]


def _loss(out):
    if torch.is_tensor(out):
        out = (out, )
    total = 0.0
    for k, t in enumerate(out):
        if torch.is_tensor(t) and t.requires_grad:
            total = total + (t * (k + 1.5)).square().sum()
    return total


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("shape", [(3, 5), (1, 1), (2, 7, 4)])
def test_gradients_equal_plain_autograd(case, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape[-1], shape[-1], generator=gen, dtype=torch.float64, requires_grad=True)
    x0 = torch.randn(*shape, generator=gen, dtype=torch.float64)
    fn = case(w)

    xa = (x0 * 2).requires_grad_(True)
    ref_loss = _loss(fn(xa * 1.0))
    ref_loss.backward()
    ref_x, ref_w = xa.grad.clone(), w.grad.clone()
    w.grad = None

    xb = (x0 * 2).requires_grad_(True)
    loss = _loss(checkpoint_offloaded(fn, xb * 1.0))
    loss.backward()
    assert torch.equal(loss.detach(), ref_loss.detach())
    assert torch.equal(xb.grad, ref_x)
    assert torch.equal(w.grad, ref_w)


def test_unsaved_ends_are_released_and_saved_ones_kept():
    seen = []

    def record(fn):

        def run(x):
            out = fn(x)
            seen.append((x, out))
            return out

        return run

    w = torch.randn(6, 6, requires_grad=True)
    for case, released in ((_linear_tail, True), (_exp_tail, False)):
        seen.clear()
        x = torch.randn(4, 6, requires_grad=True)
        _loss(checkpoint_offloaded(record(case(w)), x * 1.0)).backward()
        assert len(seen) == 2  # the forward and the recomputation
        restored, recomputed = seen[1]
        # the restored input is a copy only on a device; on the CPU it is the host tensor itself and stays
        assert restored.untyped_storage().nbytes() > 0
        assert (recomputed.untyped_storage().nbytes() == 0) == released
        # the forward's own output is untouched
        assert seen[0][1].untyped_storage().nbytes() > 0


def test_host_copies_take_their_own_size_in_power_of_two_pieces():
    from deepspeed.runtime.sequence_parallel import activation_offload as ao
    for nbytes in (1, ao._FLOOR - 1, ao._FLOOR, 3 * ao._PIECE + ao._FLOOR + 5, 4097 << 20, (1 << 33) + 7):
        sizes = ao._piece_sizes(nbytes)
        assert sum(sizes) == nbytes
        # every piece but a last one below the floor is a power of two (the pinned allocator's own sizes)
        assert all(s & (s - 1) == 0 for s in sizes if s >= ao._FLOOR)
        assert sum(s < ao._FLOOR for s in sizes) <= 1 and all(s <= ao._PIECE for s in sizes)
    # the copy round-trips bit for bit (unpinned here: pinned memory needs a GPU), dtype and shape kept
    t = torch.randn(3, 5, 7, dtype=torch.float64).to(torch.bfloat16).transpose(0, 1)
    copy = ao._HostCopy(t, pin_memory=False)
    back = copy.to("cpu")
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
