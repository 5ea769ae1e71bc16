# SPDX-License-Identifier: Apache-2.0
"""``SparseTensor``: a row-sparse gradient (an embedding's, from ``sparse=True``) as indices and value rows.

Built from a natively sparse COO tensor of shape ``[rows, dim]`` (sparse in the first dimension): ``indices``
are the stored row numbers, ``values`` the ``[k, dim]`` rows, ``dense_size`` the full shape; duplicate rows
are summed first. ``add`` appends another one's rows (duplicates are summed again by ``to_coo_tensor().
coalesce()`` or ``to_dense``). The engine's ``sparse_gradients`` reduction (all-gathering these instead of
all-reducing dense gradients) is not built: sparse gradients are reduced densely.
"""

import torch


class SparseTensor:
    """See the module docstring."""

    def __init__(self, dense_tensor=None):
        self.orig_dense_tensor = dense_tensor
        if dense_tensor is None:
            self.indices = self.values = self.dense_size = None
            return
        if not dense_tensor.is_sparse:
            raise ValueError("SparseTensor is only built from a natively sparse gradient")
        self.is_sparse = True
        self.dtype = dense_tensor.dtype
        coalesced = dense_tensor.coalesce()
        self.indices = coalesced.indices().flatten()
        self.values = coalesced.values()
        self.dense_size = list(coalesced.size())

    def to_coo_tensor(self):
        """The sparse COO tensor of these rows (not coalesced after ``add``)."""
        return torch.sparse_coo_tensor(self.indices.unsqueeze(0), self.values, self.dense_size)

    def to_dense(self):
        return self.to_coo_tensor().to_dense()

    @staticmethod
    def type():
        return "deepspeed.SparseTensor"

    def sparse_size(self):
        """``(stored elements: indices plus values, elements of the dense tensor)``."""
        return self.indices.numel() + self.values.numel(), self.dense_size[0] * self.dense_size[1]

    def add(self, b):
        if self.dense_size != b.dense_size:
            raise ValueError(f"SparseTensor.add: dense sizes differ, {self.dense_size} and {b.dense_size}")
        self.indices = torch.cat([self.indices, b.indices])
        self.values = torch.cat([self.values, b.values])

    def __str__(self):
        stored, dense = self.sparse_size()
        return (f"DeepSpeed.SparseTensor(indices_size={self.indices.size()}, values_size={self.values.size()}, "
                f"dense_size={self.dense_size}, device={self.indices.device}, reduction_factor={dense / stored})")

    __repr__ = __str__
