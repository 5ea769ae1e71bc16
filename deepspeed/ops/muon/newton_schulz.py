# SPDX-License-Identifier: Apache-2.0
"""Newton-Schulz orthogonalization of a whole matrix, the matrix half of Muon's step.

Both iterations compute the same quintic polynomial of ``X = G / (||G||_F + 1e-7)``, with the coefficients
``(a, b, c) = (3.4445, -4.7750, 2.0315)`` applied ``steps`` times (``X <- a X + (b A + c A^2) X``, ``A = X X^T``),
on the wide orientation (a tall matrix is transposed first and back after):

* ``"standard"``: the iteration as written;
* ``"gram"`` (upstream's default ``ns_method``): the same polynomial accumulated on the small Gram matrix
  ``R = X X^T`` (``Q`` collects the left factor, ``X`` is multiplied once at the end), with one restart after two
  iterations (``X <- Q X``, ``R`` recomputed) to keep half precision stable; a square matrix takes the standard
  iteration (no saving there).

The compute dtype follows upstream's choice on an accelerator (``"gram"``: float16, ``"standard"``: bfloat16);
on the host it is float32 (upstream picks float16 or bfloat16 there too; see docs/zero.md). ``"gram"``
normalizes before the cast, in float32 when the input is float16, so a large finite gradient does not reach the
iteration as infinity.
"""

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("gram", "standard")
NORM_EPS = 1e-7
GRAM_RESTART = 2


def ns_compute_dtype(ns_method, device):
    """The dtype the iteration of ``ns_method`` runs in on ``device`` (see the module docstring)."""
    if torch.device(device).type == "cpu":
        return torch.float32
    return torch.float16 if ns_method == "gram" else torch.bfloat16


def aspect_scale(rows, cols):
    """Muon's update scale ``sqrt(max(1, rows / cols))``."""
    return math.sqrt(rows / cols) if rows > cols else 1.0


def _standard(X, steps):
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return X


def _gram(X, steps):
    a, b, c = NS_COEFFICIENTS
    R = X @ X.mT
    Q = None
    for i in range(steps):
        if i == GRAM_RESTART:  # fold Q into X and start the accumulation again
            X = Q @ X
            R = X @ X.mT
            Q = None
        Z = b * R + c * (R @ R)
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = a * Q + Z @ Q
        if i < steps - 1 and i + 1 != GRAM_RESTART:  # R of the next iterate: (a + Z) R (a + Z)
            RZ = a * R + Z @ R
            R = a * RZ + Z @ RZ
    return Q @ X


def orthogonalize(G, steps=5, ns_method="gram"):
    """Newton-Schulz of the matrix ``G`` (2-D; batched over leading dimensions), in :func:`ns_compute_dtype`.

    Returns a tensor of ``G``'s shape in the compute dtype.
    """
    if ns_method not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {NS_METHODS}, got {ns_method!r}")
    compute = ns_compute_dtype(ns_method, G.device)
    tall = G.size(-2) > G.size(-1)
    if ns_method == "gram":
        X = G.float() if G.dtype == torch.float16 else G
        X = X.mT if tall else X
        X = (X / (X.norm(dim=(-2, -1), keepdim=True) + NORM_EPS)).to(compute)
        X = _standard(X, steps) if X.size(-1) <= X.size(-2) else _gram(X, steps)
    else:
        X = G.to(compute)
        X = X.mT if tall else X
        X = _standard(X / (X.norm(dim=(-2, -1), keepdim=True) + NORM_EPS), steps)
    return X.mT if tall else X


def muon_direction(update, steps=5, ns_method="gram"):
    """The orthogonalized, scaled update of one matrix parameter from its (Nesterov) momentum ``update``.

    A parameter with more than two dimensions (a convolution filter) is orthogonalized as the matrix
    ``update.view(shape[0], -1)``, and scaled by that matrix's aspect ratio. The result has ``update``'s shape and
    dtype.
    """
    matrix = update.reshape(update.shape[0], -1)
    out = orthogonalize(matrix, steps, ns_method).float() * aspect_scale(*matrix.shape)
    return out.to(update.dtype).view(update.shape)
