# SPDX-License-Identifier: Apache-2.0
"""The top Hessian eigenvalue of each block of a model, by power iteration on Hessian-vector products.

A *block* is an entry of the container module named by ``layer_name`` (a dotted attribute path such as
``bert.encoder.layer``): its first ``layer_num`` entries (all of them when ``layer_num`` is 0). For each block with
parameters ``w`` the power iteration runs on ``H = d^2 L / dw^2`` (the block's diagonal block of the Hessian):

    v <- random unit vector;  repeat:  Hv = d(g . v)/dw  with g = dL/dw;  lambda = v . Hv;  v <- Hv / |Hv|

until ``lambda`` changes by less than ``tol`` relative to its size, or ``max_iter`` products; ``lambda`` converges
to the eigenvalue of largest magnitude (returned with its sign). ``stability`` keeps divisions away from zero.

Gradients for the products come from ``torch.autograd.grad``: with a ``loss``, ``g`` is taken with
``create_graph=True`` (the loss's graph is retained, so a training backward can still run over it); without one,
``g`` is each parameter's ``.grad`` as left by a ``backward(create_graph=True)`` (upstream's protocol, for modules no
engine owns). Every product runs inside :func:`deepspeed.runtime.backward.registry.suspended`, and no ``.grad`` is
written: an engine's gradient pipeline never sees these backward passes, so training is unchanged. The start
vectors come from a generator of their own (seeded per block), so the global RNG is not advanced either.

The engine computes it in the ``engine.backward`` of an accumulation boundary's micro-step, from that micro-step's
loss (not divided by the accumulation steps, not loss-scaled), every ``gas_boundary_resolution`` boundaries, and
writes one monitor event per block, ``Train/Eigenvalues/ModelBlockParam_{i}``, with the signed eigenvalue.
"""

import logging

import torch

from deepspeed.runtime.backward import registry
from deepspeed.utils.logging import log_dist

SEED = 1234


class Eigenvalue:
    """Power iteration per block (see the module docstring); arguments as the ``eigenvalue`` config keys."""

    def __init__(self,
                 verbose=False,
                 max_iter=100,
                 tol=1e-2,
                 stability=1e-6,
                 gas_boundary_resolution=1,
                 layer_name="",
                 layer_num=0):
        if max_iter < 1:
            raise ValueError(f"eigenvalue.max_iter must be >= 1, got {max_iter}")
        if gas_boundary_resolution < 1:
            raise ValueError(f"eigenvalue.gas_boundary_resolution must be >= 1, got {gas_boundary_resolution}")
        self.verbose = verbose
        self.max_iter = int(max_iter)
        self.tol = float(tol)
        self.stability = float(stability)
        self.gas_boundary_resolution = int(gas_boundary_resolution)
        self.layer_name = layer_name
        self.layer_num = int(layer_num)
        self._warned_blocks = set()

    # ------------------------------------------------------------------ blocks
    def get_layers(self, module):
        """The container named by ``layer_name`` inside ``module`` (``module`` itself for an empty name)."""
        container = module
        walked = []
        for part in [p for p in self.layer_name.split(".") if p]:
            walked.append(part)
            if not hasattr(container, part):
                raise ValueError(f"config key 'eigenvalue.layer_name' ({self.layer_name!r}): "
                                 f"{type(module).__name__} has no submodule '{'.'.join(walked)}'")
            container = getattr(container, part)
        return container

    def get_blocks(self, module):
        """The blocks of ``module``: the first ``layer_num`` entries of its ``layer_name`` container."""
        layers = self.get_layers(module)
        try:
            count = len(layers)
        except TypeError:
            raise ValueError(f"config key 'eigenvalue.layer_name' ({self.layer_name!r}) names a "
                             f"{type(layers).__name__}, not a list of blocks (a ModuleList or Sequential)") from None
        wanted = self.layer_num or count
        if wanted > count:
            raise ValueError(f"config key 'eigenvalue.layer_num' is {self.layer_num}, but "
                             f"'{self.layer_name}' has only {count} blocks")
        return [layers[i] for i in range(wanted)]

    # ------------------------------------------------------------ computation
    def compute_block_eigenvalues(self, module, loss=None, scale=1.0):
        """The top eigenvalue of each block's Hessian of ``loss`` (or of the ``.grad`` graphs), divided by
        ``scale`` (the loss scale the gradients carry). Returns a list, one float per block."""
        blocks = self.get_blocks(module)
        params_of = [[p for p in block.parameters() if p.requires_grad] for block in blocks]
        with registry.suspended():
            grads_of = self._first_order(params_of, loss)
            values = []
            for index, (params, grads) in enumerate(zip(params_of, grads_of)):
                value, iterations = self._power_iteration(params, grads, index)
                values.append(value / scale)
                if self.verbose:
                    log_dist(f"eigenvalue: block {index}, {iterations} power iterations, eigenvalue {value / scale}",
                             ranks=[0])
        return values

    def compute_eigenvalue(self, module, device=None, scale=1.0, loss=None):
        """Upstream's form: ``{id(param): (normalised eigenvalue, block index)}`` for every parameter of every
        block, the eigenvalues mapped to ``|lambda| / max |lambda|`` (1.0 for a block whose eigenvalue is 0).
        ``device`` is accepted for compatibility (vectors live on each parameter's device)."""
        values = self.compute_block_eigenvalues(module, loss=loss, scale=scale)
        normalised = self.post_process(values)
        result = {}
        for index, (block, value) in enumerate(zip(self.get_blocks(module), normalised)):
            for param in block.parameters():
                result[id(param)] = (value, index)
        return result

    @staticmethod
    def post_process(values):
        if not values:
            return []
        largest = max(abs(v) for v in values)
        return [abs(v) / largest if v != 0.0 and largest > 0 else 1.0 for v in values]

    def _first_order(self, params_of, loss):
        if loss is None:
            result = []
            for params in params_of:
                pairs = [(p, p.grad) for p in params if p.grad is not None and p.grad.grad_fn is not None]
                params[:] = [p for p, _ in pairs]
                result.append([g for _, g in pairs])
            return result
        flat = [p for params in params_of for p in params]
        if not flat:
            return [[] for _ in params_of]
        grads = torch.autograd.grad(loss, flat, create_graph=True, retain_graph=True, allow_unused=True)
        result, start = [], 0
        for params in params_of:
            pairs = [(p, g) for p, g in zip(params, grads[start:start + len(params)]) if g is not None]
            start += len(params)
            params[:] = [p for p, _ in pairs]
            result.append([g for _, g in pairs])
        return result

    def _power_iteration(self, params, grads, index):
        if not params or not any(g.requires_grad for g in grads):
            if index in self._warned_blocks:
                return 0.0, 0
            self._warned_blocks.add(index)
            log_dist(
                f"eigenvalue: block {index} has no second-order gradient (no parameter, or an operator without "
                f"a double backward); its eigenvalue is reported as 0",
                ranks=[0],
                level=logging.WARNING)
            return 0.0, 0
        vector = self._start_vector(params, index)
        value, previous = 0.0, None
        iterations = 0
        for iterations in range(1, self.max_iter + 1):
            products = torch.autograd.grad(grads, params, grad_outputs=vector, retain_graph=True, allow_unused=True)
            products = [
                torch.zeros_like(p) if h is None else torch.nan_to_num(h, nan=0.0, posinf=0.0, neginf=0.0)
                for p, h in zip(params, products)
            ]
            value = float(_dot(vector, products))
            norm = float(_dot(products, products))**0.5
            if norm == 0.0:
                value = 0.0
                break
            vector = [h / (norm + self.stability) for h in products]
            if previous is not None and abs(value - previous) <= self.tol * (abs(value) + self.stability):
                break
            previous = value
        return value, iterations

    def _start_vector(self, params, index):
        vector = []
        for position, param in enumerate(params):
            generator = torch.Generator(device=param.device)
            generator.manual_seed(SEED + 1000 * index + position)
            vector.append(torch.randn(param.shape, generator=generator, device=param.device, dtype=param.dtype))
        norm = float(_dot(vector, vector))**0.5
        return [v / (norm + self.stability) for v in vector]


def _dot(xs, ys):
    """``sum_i <x_i, y_i>`` accumulated in fp32."""
    total = torch.zeros((), dtype=torch.float32, device=xs[0].device)
    for x, y in zip(xs, ys):
        total = total + torch.sum(x.float() * y.float()).to(total.device)
    return total
