# SPDX-License-Identifier: Apache-2.0
"""A linear layer whose autograd function saves the weight itself, not a view of it (upstream's
``LinearFunctionForZeroStage3`` / ``LinearModuleForZeroStage3`` / ``zero3_linear_wrap``).

``y = x @ W.T + b`` with ``x`` of any rank ``>= 1``. The backward computes ``dx = dy @ W``,
``dW = dy.T @ x`` over all leading dimensions and ``db = sum(dy)``, under the autocast state the forward
ran with (so an outer autocast region cannot change the backward's precision). The forward is
``torch.nn.functional.linear``, so under ``torch.autocast`` the input, weight and bias are cast together and the
output has the autocast dtype, as a ``torch.nn.Linear``'s has. Under this runtime's ZeRO-3
a released parameter keeps its storage object (emptied, refilled by the next gather), so torch's own
``Linear`` is already safe there; this layer exists for code that names it.

``autocast_custom_fwd`` / ``autocast_custom_bwd`` (upstream's names) are torch's ``torch.amp.custom_fwd`` /
``custom_bwd`` bound to the accelerator's device type, for code that decorates its own autograd functions with them
(``noop_decorator`` on a torch without them).
"""

import functools
import math

import torch
from torch.nn import Module, Parameter, init

from deepspeed.accelerator import get_accelerator

_torch_linear = torch.nn.functional.linear  # taken at import: code that patches F.linear cannot make this recurse


def _device_type():
    name = get_accelerator().device_name()
    return name.split(":")[0]


def noop_decorator(func):
    return func


if hasattr(torch, "amp") and hasattr(torch.amp, "custom_fwd"):
    autocast_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type=_device_type())
    autocast_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type=_device_type())
else:  # torch < 2.4: the device module's decorators, where it has them
    _legacy_amp = getattr(getattr(torch, _device_type(), None), "amp", None)
    autocast_custom_fwd = getattr(_legacy_amp, "custom_fwd", noop_decorator)
    autocast_custom_bwd = getattr(_legacy_amp, "custom_bwd", noop_decorator)


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """See the module docstring. Written in the ``forward`` / ``setup_context`` form, so ``torch.func`` transforms
    (``grad``, ``vmap``: the rule is generated) can run through it. ``ctx._fwd_used_autocast`` and ``ctx._dtype``
    (upstream's names) hold the autocast state of the forward, which the backward runs under."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input, weight, bias=None):
        # torch's own linear op: under autocast the input, weight and bias are cast together, as for nn.Linear
        return _torch_linear(input, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight = inputs[0], inputs[1]
        bias = inputs[2] if len(inputs) > 2 else None
        device_type = _device_type()
        ctx._fwd_used_autocast = torch.is_autocast_enabled(device_type)
        ctx._dtype = torch.get_autocast_dtype(device_type)
        ctx.save_for_backward(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        with torch.autocast(device_type=_device_type(), enabled=ctx._fwd_used_autocast, dtype=ctx._dtype):
            grad_input = grad_weight = grad_bias = None
            if ctx.needs_input_grad[0]:
                grad_input = grad_output.matmul(weight)
            if ctx.needs_input_grad[1]:
                if grad_output.dim() == 1:
                    grad_weight = grad_output.unsqueeze(-1) * input.unsqueeze(0)
                else:
                    grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(
                        input.reshape(-1, input.shape[-1]))
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = grad_output if grad_output.dim() == 1 else grad_output.reshape(
                    -1, grad_output.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(input, weight, bias=None):
    """``x @ weight.T + bias`` through :class:`LinearFunctionForZeroStage3`."""
    return LinearFunctionForZeroStage3.apply(input, weight, bias)


class LinearModuleForZeroStage3(Module):
    """``torch.nn.Linear`` (same parameters, same initialisation) whose forward is :func:`zero3_linear_wrap`."""

    __constants__ = ["in_features", "out_features"]

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = Parameter(torch.empty(out_features, in_features))
        if bias:
            self.bias = Parameter(torch.empty(out_features))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return zero3_linear_wrap(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
